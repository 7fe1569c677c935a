"""One drafter rank stepping alone through the drafter's own step protocol (`app/training/loop.py`'s
RankLoop, driven by `drive` as `actors/drafter.py` drives it), fed from precomputed batches: what the
benches that time the training step run (`python -m app.bench e2e`'s standalone drafter, `bench gpu`'s
drafter step), so they time the loop the run trains with, not a copy of it.
"""
from __future__ import annotations

import time

import torch

from app.training.effects import Fetched, LoopConfig
from app.training.loop import QuietHooks, RankLoop, drive


class AloneOps(QuietHooks):
    """The step protocol's operations for a group of one: each pull is answered at once from precomputed
    (job id, HiddenBatch) pairs; once they are out, `Drained` while a job is not acked yet and then
    end-of-stream, as the pool answers. Compute is the actor's (the payload made a TrainBatch on the
    device, then the trainer's micro-step) and the reduce of a group of one is the trainer's own step."""

    def __init__(self, trainer, batches: list, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.trainer, self.batches, self.device, self.dtype = trainer, iter(batches), device, dtype
        self.answer: Fetched | None = None
        self.unacked: set[int] = set()
        self.tokens = 0  # trained in the steps done

    def start_pull(self, eff) -> None:
        from app.messages import Drained, EndOfStream, ItemMeta, PulledItem

        self.unacked.difference_update(eff.acks)
        job = next(self.batches, None)
        if job is None:
            self.answer = Fetched(Drained() if self.unacked else EndOfStream())
            return
        self.unacked.add(job[0])
        self.answer = Fetched(PulledItem(ItemMeta(job[0], 0, 1, 0, 0, 0, 0, 0.0), None), job[1])

    def pull_answered(self, _) -> bool:
        return True

    def await_pull(self, _) -> Fetched:
        return self.answer

    def compute(self, eff) -> None:
        from app.model.loss import TrainBatch

        self.trainer.micro_step(TrainBatch.from_hidden_batch(eff.payload, self.device, self.dtype),
                                eff.item.meta.job_id)

    def send_acks(self, eff) -> None:
        self.unacked.difference_update(eff.job_ids)

    def reduce(self, eff):
        return self.trainer.finish_step(stop_requested=eff.stop, eos=eff.eos)

    def sleep(self, eff) -> None:
        time.sleep(eff.seconds)

    def gather(self, eff) -> list[list[int]]:
        return [list(eff.job_ids)]

    def step_done(self, eff) -> None:
        self.tokens += eff.totals.tokens


def step_alone(trainer, batches: list, grad_accum: int, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> int:
    """Train `batches` ((job id, HiddenBatch) pairs) through the step loop, `grad_accum` micro-batches a
    step, from the trainer's current step; returns the tokens the steps trained."""
    ops = AloneOps(trainer, batches, device, dtype)
    drive(RankLoop(LoopConfig(0, 1, grad_accum, start_step=trainer.step)), ops)
    return ops.tokens
