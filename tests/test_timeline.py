"""The timeline's step rows carry the latest measured tau (issue 16: tau reaches the step records)."""
from __future__ import annotations

from app.messages import StepRecord
from app.run.outputs.timeline import Timeline, read_timeline


def _rec(rank: int, step: int) -> StepRecord:
    return StepRecord(rank=rank, step=step, epoch=0, loss=1.0, weight_sum=1.0, correct=0.5, tokens=10,
                      accept_len=1.2, per_pos_acc=[0.5], compute_s=0.1, data_wait_s=0.0)


def test_rank_zero_step_rows_carry_the_latest_tau(tmp_path) -> None:
    tl = Timeline(tmp_path, clock=lambda: 0.0)
    tl.add_records([_rec(0, 1), _rec(1, 1)])
    tl.evaluation(1, 2.5, [0.9])
    tl.add_records([_rec(0, 2), _rec(1, 2)])
    tl.evaluation(2, 3.25, [0.95])
    tl.add_records([_rec(0, 3)])
    tl.close()
    steps = [r for r in read_timeline(tmp_path) if r["k"] == "step"]
    assert [(r["step"], r["rank"], r.get("tau"), r.get("tau_step")) for r in steps] == [
        (1, 0, None, None), (1, 1, None, None), (2, 0, 2.5, 1), (2, 1, None, None), (3, 0, 3.25, 2)]
