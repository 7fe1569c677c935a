"""The benches that time the drafter step (bench e2e's standalone drafter, bench gpu's drafter step) run the
drafter's own step protocol (app/training/loop.py) through app/bench/compute/alone.py: the trainer sees the
micro-batches and steps a rank of a group of one would, the last job acked before the stream ends (as the
pool ends it), and the tokens are the steps'."""
from __future__ import annotations

from types import SimpleNamespace

from app.bench.compute.alone import AloneOps
from app.training.effects import LoopConfig
from app.training.loop import RankLoop, drive
from tests.helpers import hidden_batch


class CountingTrainer:
    """Records the calls the loop makes; a step's tokens are 10 per micro-batch in it."""

    def __init__(self) -> None:
        self.calls: list = []
        self.step, self.pending = 0, 0

    def micro_step(self, batch, job_id: int) -> None:
        self.calls.append(("micro", job_id))
        self.pending += 1

    def finish_step(self, stop_requested: bool = False, eos: bool = False):
        self.step += 1 if self.pending else 0
        self.calls.append(("step", eos))
        n, self.pending = self.pending, 0
        return SimpleNamespace(step=self.step, active_ranks=int(n > 0), eos_ranks=int(eos), stop=stop_requested,
                               nonfinite="", halt=False, tokens=10 * n)


def test_the_standalone_drafter_steps_through_the_rank_loop_in_grad_accum_groups() -> None:
    trainer = CountingTrainer()
    ops = AloneOps(trainer, [(j, hidden_batch(j, seqs=1, tokens=4, width=4, dtype="float32")) for j in (7, 8, 9, 10, 11)])
    outcome = drive(RankLoop(LoopConfig(0, 1, 2)), ops)
    assert trainer.calls == [("micro", 7), ("micro", 8), ("step", False), ("micro", 9), ("micro", 10),
                             ("step", False), ("micro", 11), ("step", False), ("step", True)]
    assert outcome.steps == 3 and not outcome.stopped and ops.tokens == 50
