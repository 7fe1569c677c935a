"""The step log and its independent count of trained jobs (no Ray)."""
from __future__ import annotations

import random
from pathlib import Path

from app.chaos import plan_faults
from app.messages import StepRecord
from app.run.step_log import StepLog, count_trained


def _rec(rank: int, step: int, *jobs: int) -> StepRecord:
    return StepRecord(rank, step, 0, loss=1.0, weight_sum=1.0, correct=0.5, tokens=10, accept_len=1.0,
                      compute_s=0.1, data_wait_s=0.0, job_ids=tuple(jobs))


def test_a_rollback_discards_the_steps_after_the_checkpoint(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "steps.jsonl")
    log.group_start(0)
    log.records([_rec(0, 1, 10), _rec(1, 1, 11), _rec(0, 2, 12), _rec(1, 2, 13), _rec(0, 3, 14)])
    log.group_start(2)  # crashed after step 3; rebuilt from the checkpoint of step 2: job 14 is lost
    log.records([_rec(0, 3, 14), _rec(1, 3, 15), _rec(0, 4, 16)])
    counts = count_trained(tmp_path / "steps.jsonl")
    assert counts.times == {10: 1, 11: 1, 12: 1, 13: 1, 14: 1, 15: 1, 16: 1} and counts.group_starts == 2
    assert counts.count(scheduled=8) == {"trained_once": 7, "trained_twice": 0, "never_trained": 1}
    assert counts.count(scheduled=8, quarantined=1)["never_trained"] == 0


def test_double_training_shows(tmp_path: Path) -> None:
    """A job re-issued although it was inside the resumed weights appears twice in the lineage."""
    log = StepLog(tmp_path / "steps.jsonl")
    log.group_start(0)
    log.records([_rec(0, 1, 1), _rec(0, 2, 2)])
    log.group_start(2)
    log.records([_rec(0, 3, 2), _rec(0, 4, 3)])
    assert count_trained(tmp_path / "steps.jsonl").count(scheduled=3) == \
        {"trained_once": 2, "trained_twice": 1, "never_trained": 0}


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    StepLog(path).records([_rec(0, 1, 7)])
    with path.open("a") as f:
        f.write('{"rank": 0, "step": 2, "job_')
    assert count_trained(path).times == {7: 1}


def test_chaos_plans_the_pool_and_the_driver_once() -> None:
    kinds = plan_faults(8, random.Random(0))
    assert len(kinds) == 8 and kinds.count("pool") == 1 and kinds.count("driver") == 1
    assert set(kinds) <= {"pool", "driver", "target", "drafter"}
    assert plan_faults(8, random.Random(0)) == kinds  # seeded
    assert plan_faults(1, random.Random(0)) in (["target"], ["drafter"])


def test_steps_whose_records_died_with_the_pool_are_counted_as_unlogged(tmp_path: Path) -> None:
    """The pool died after the checkpoint of step 3 but before the driver drained step 3's records:
    the resume at 3 shows one unlogged step (its jobs are in the weights, not in the log)."""
    log = StepLog(tmp_path / "steps.jsonl")
    log.group_start(0)
    log.records([_rec(0, 1, 1), _rec(0, 2, 2)])
    log.group_start(3)
    log.records([_rec(0, 4, 4)])
    counts = count_trained(tmp_path / "steps.jsonl")
    assert counts.unlogged_steps == 1 and counts.count(scheduled=4)["never_trained"] == 1
