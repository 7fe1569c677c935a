"""The chaos bench's pure parts (no Ray): which faults it plans, and when the next one is due."""
from __future__ import annotations

import random
from pathlib import Path

from app.bench.runs.chaos import plan_faults, trained_since
from app.training.step_log import StepLog


def test_chaos_plans_the_pool_and_the_driver_once() -> None:
    kinds = plan_faults(8, random.Random(0))
    assert len(kinds) == 8 and kinds.count("pool") == 1 and kinds.count("driver") == 1
    assert kinds.count("sticky") == 1  # issue 22 item 1: a broken-but-alive target
    assert set(kinds) <= {"pool", "driver", "sticky", "target", "drafter"}
    assert "sticky" not in plan_faults(3, random.Random(0))  # the 3-fault rehearsal is unchanged
    assert plan_faults(8, random.Random(0)) == kinds  # seeded
    assert plan_faults(1, random.Random(0)) in (["target"], ["drafter"])


def test_the_gap_to_the_next_fault_counts_steps_of_the_group_now_training(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    log = StepLog(path)
    log.group_start(0)
    for step in range(1, 4):
        log.step(step, [[step * 10], [step * 10 + 1], [step * 10 + 2]])  # three ranks: one line each
    lines = path.read_text().splitlines()
    assert trained_since(lines, need_starts=1, after=0) == 3  # steps, not rank lines
    assert trained_since(lines, need_starts=2, after=0) == 0  # the next group has not started
    assert trained_since(lines, need_starts=1, after=len(lines)) == 0  # a fault just fired
    log.group_start(2)  # the group came back from the checkpoint of step 2
    log.step(3, [[30], [31], [32]])
    lines = path.read_text().splitlines()
    assert trained_since(lines, need_starts=2, after=0) == 1  # only the new group's steps count
    assert trained_since(lines, need_starts=2, after=len(lines) - 3) == 1
