"""The step protocol's operations for one drafter rank, and the prefetch thread's pull.

`RankOps` carries out each effect `RankLoop` (app/training/loop.py) yields: Ray calls to the pool (one pull
and its payload fetch in flight in a worker thread while the rank computes), the trainer, the process
group's all-gather, the step log, checkpoints, evaluation offers, the drafter faults and the phases the
supervisor's watchdog reads. It is handed the parts it uses (the pool handle, the trainer, the stager, the
rank's `RankState`, the step log), not the `DrafterActor` that holds them (actors/drafter.py); rank 0's
checkpoint is `save_rank` of those parts.
`fetch_next` is that worker thread's pull, which the transport benches time as it is.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from app.faults import fire_once
from app.messages import Drained, DrafterPhase, DrafterProgress, EndOfStream, split_job_id
from app.payload.layers import layer_columns, select_layers
from app.payload.nixl_receive import NixlReceiver
from app.training.drafter_io import DrafterSetup, step_record
from app.training.effects import (AwaitPull, Checkpoint, Compute, Fetched, Gather, NonFinite, OfferEval, PullAnswered,
                                  ReadStop, Reduce, SendAcks, Sleep, StartPull, StepDone, StepStart, Updated)


@dataclass
class RankState:
    """What the step protocol changes on a rank and the actor reads back: the furthest epoch trained, the job
    ids inside the weights (rank 0 checkpoints them), the step the watchdog sees and the phase it is in (one
    tuple, read atomically from the actor's second thread)."""

    rank: int
    epoch: int = 0
    ledger: set[int] = field(default_factory=set)
    step_now: int = 0
    phase: tuple[str, float] = field(default_factory=lambda: (DrafterPhase.SETUP, time.monotonic()))

    def enter(self, phase: str) -> None:
        self.phase = (phase, time.monotonic())

    def progress(self) -> DrafterProgress:
        phase, since = self.phase
        return DrafterProgress(self.rank, phase, time.monotonic() - since, self.step_now)


class RankOps:
    """The step protocol's operations (app/training/loop.py) for one rank: Ray calls to the pool (one pull
    and its payload fetch in flight in a worker thread while the rank computes), the trainer, the process
    group, the step log, checkpoints (`save_rank`), the drafter faults and the watchdog's phases."""

    def __init__(self, pool: Any, generation: int, setup: DrafterSetup, trainer: Any, stager: Any, device: Any,
                 dtype: Any, state: RankState, step_log: Any) -> None:
        self.pool, self.generation, self.cfg, self.state = pool, generation, setup, state
        self.trainer, self.stager, self.device, self.dtype = trainer, stager, device, dtype
        self.rank, self.step_log = state.rank, step_log
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self.pending: Future | None = None
        self.t_step = time.perf_counter()
        self.last_ckpt: str | None = None
        self.skipped = 0  # jobs of skipped non-finite steps
        # pool.transport=nixl payloads into reused buffers (pinned on CUDA: staged from in place); others pass through
        cuda = device.type == "cuda"
        self.receiver = NixlReceiver(pin=cuda)
        if cuda and stager.store is None:
            stager.store = self.receiver

    def close(self) -> None:
        """Free the stager's and the receiver's buffers once no pull is in flight (one still running uses them)."""
        if self.pending is None or self.pending.done():
            self.receiver.close()
            self.stager.close()

    def step_start(self, _: StepStart) -> None:
        self.t_step = time.perf_counter()

    def start_pull(self, eff: StartPull) -> None:
        self.pending = self.executor.submit(self._fetch, list(eff.acks))

    def pull_answered(self, _: PullAnswered) -> bool:
        return self.pending is None or self.pending.done()

    def await_pull(self, _: AwaitPull) -> Fetched:
        assert self.pending is not None, "the loop awaits a pull it never started"
        self.state.enter(DrafterPhase.WAIT_DATA)
        t0 = time.perf_counter()
        item, payload = self.pending.result()
        self.pending = None
        self.state.enter(DrafterPhase.COMPUTE)
        return Fetched(item, payload, time.perf_counter() - t0)

    def _fetch(self, acks: list[int]):
        return fetch_next(self.pool, self.rank, self.generation, acks, self._stage,
                          receive=self.receiver.receive)

    def _stage(self, batch):
        """A run of a sweep takes its own layers out of the union the targets captured, then stages."""
        captured = self.cfg.feature_layer_ids
        columns = layer_columns(captured, self.cfg.layer_ids) if captured else None
        if columns is not None:
            batch = select_layers(batch, columns, len(captured))
        return self.stager.stage(batch)

    def compute(self, eff: Compute) -> None:
        from app.model.loss import TrainBatch

        job_id = eff.item.meta.job_id
        self.state.epoch = max(self.state.epoch, split_job_id(job_id)[0])
        if isinstance(eff.payload, TrainBatch):  # staged on the GPU by the prefetch thread
            batch = self.stager.ready(eff.payload)
        else:
            batch = TrainBatch.from_hidden_batch(eff.payload, self.device, self.dtype)
        self.trainer.micro_step(batch, job_id)

    def send_acks(self, eff: SendAcks) -> None:
        import ray

        ray.get(self.pool.ack.remote(self.rank, list(eff.job_ids), self.generation))

    def read_stop(self, _: ReadStop) -> bool:
        import ray

        return bool(ray.get(self.pool.stop_requested.remote()))

    def reduce(self, eff: Reduce):
        self._maybe_stall(eff.eos)
        self.state.enter(DrafterPhase.COLLECTIVE)
        stats = self.trainer.finish_step(stop_requested=eff.stop, eos=eff.eos)
        self.state.step_now = self.trainer.step
        return stats

    def sleep(self, eff: Sleep) -> None:
        time.sleep(eff.seconds)

    def updated(self, eff: Updated) -> None:
        self._maybe_crash(eff.step)

    def nonfinite(self, eff: NonFinite) -> None:
        if eff.halt:  # the driver says it, in one line, from the result
            return
        self.skipped += len(eff.job_ids)
        if self.rank == 0:
            print(f"WARNING: step {eff.step} not applied ({eff.reason}); train.on_nonfinite=skip: its jobs are "
                  "counted as skipped_nonfinite, not learned", flush=True)

    def gather(self, eff: Gather) -> list[list[int]]:
        import torch.distributed as dist

        gathered: list[list[int]] = [[] for _ in range(self.cfg.world_size)]
        dist.all_gather_object(gathered, list(eff.job_ids))
        return gathered

    def step_done(self, eff: StepDone) -> None:
        self.state.ledger.update(j for ids in eff.gathered for j in ids)
        if self.step_log:  # before any checkpoint of this step
            self.step_log.step(eff.step, eff.gathered)
        step_s = time.perf_counter() - self.t_step
        self.pool.report_step.remote(  # fire and forget: telemetry must not slow the step
            step_record(self.rank, eff.step, self.state.epoch, eff.totals, eff.job_ids, step_s, eff.wait_s))

    def checkpoint(self, _: Checkpoint) -> None:
        self.state.enter(DrafterPhase.COMPUTE)
        self.last_ckpt = save_rank(self.cfg, self.trainer, self.state)

    def offer_eval(self, eff: OfferEval) -> None:
        """Rank 0: put the current weights in the object store for an evaluation on a target; the pool
        keeps the newest offer. Fire and forget: training goes on at once (app/run/evaluate/runner.py)."""
        import ray

        from app.model.drafter_tau import weights_to_numpy
        from app.training.retry import transient_object_errors, with_retries

        weights = weights_to_numpy(self.trainer.drafter)
        self.pool.offer_eval.remote(eff.step, [with_retries(lambda: ray.put(weights), transient_object_errors())])

    # ---- the drafter faults (faults.*), on the step path ----------------------------------------------

    def _maybe_stall(self, eos: bool) -> None:
        # The last rank hangs outside any collective (the others wait in the all-reduce): at the
        # configured step, or when its stream ended first (then nothing is buffered any more).
        at = self.cfg.faults.stall_drafter_at_step
        if at >= 0 and self.rank == self.cfg.world_size - 1 and (self.trainer.step + 1 >= at or eos) \
                and fire_once(self.cfg.checkpoint.dir, "stall_drafter"):
            self.state.enter(DrafterPhase.COMPUTE)
            time.sleep(10**6)  # only the watchdog gets us out

    def _maybe_crash(self, step: int) -> None:
        # After the step's update but before its ack: the jobs are trained and not yet in the ledger.
        if self.rank == 0 and step == self.cfg.faults.kill_drafter_at_step and fire_once(
                self.cfg.checkpoint.dir, "kill_drafter"):
            os._exit(1)


def save_rank(setup: DrafterSetup, trainer: Any, state: RankState) -> str:
    """Rank 0: write the checkpoint (weights, optimizer, scheduler, RNG, step, epoch, ledger); returns its path."""
    from app.storage import fence
    from app.training.checkpoint import GENERATION_KEY, TrainState, rng_state, save_checkpoint

    t = trainer
    ckpt = TrainState(step=t.step, epoch=state.epoch, ledger=sorted(state.ledger), drafter=t.drafter.state_dict(),
                      optimizer=t.optimizer.state_dict(), scheduler=t.scheduler.state_dict(), rng=rng_state(),
                      extra={"data_fingerprint": setup.data_fingerprint, GENERATION_KEY: setup.group_generation})
    with fence.stop_when_fenced():  # another run holds the folder now: one line, and this rank ends
        return str(save_checkpoint(setup.checkpoint.dir, ckpt, setup.checkpoint.keep))


def fetch_next(pool, rank: int, generation: int, acks: list[int], stage, on_pulled=None, receive=None):
    """The prefetch thread's work: pull one item (acks riding along) and fetch and `stage` its payload.
    Returns (pulled, staged payload), or (EndOfStream | Drained, None). `python -m app.bench transport`
    times this same function (`on_pulled()` marks the pull's answer). `receive` (a `NixlReceiver`'s) reads
    a `pool.transport=nixl` payload out of its target (a blocking get: NIXL refs cannot be awaited); a
    target that died before the read raises OwnerDiedError, an ObjectLostError: re-queued as below."""
    import ray
    from ray.exceptions import ObjectLostError

    from app.training.retry import transient_object_errors, with_retries

    transient = transient_object_errors()  # a full store, a timed-out fetch: tried again before giving up the job
    while True:
        pulled = ray.get(pool.pull.remote(rank, generation, acks))
        acks = []
        if isinstance(pulled, (EndOfStream, Drained)):
            return pulled, None
        if on_pulled is not None:
            on_pulled()
        try:  # CUDA: the stager copies it to the GPU (pinned, side stream), in this thread
            get = (lambda: receive(ray.get(pulled.payload_ref))) if receive else (lambda: ray.get(pulled.payload_ref))
            return pulled, stage(with_retries(get, transient))
        except ObjectLostError:  # the node holding it died: recompute that job, pull another
            ray.get(pool.payload_lost.remote(rank, pulled.meta.job_id, generation))
