"""The step log and its independent count of trained jobs (no Ray)."""
from __future__ import annotations

from pathlib import Path

from app.training.step_log import StepLog, count_trained


def test_a_rollback_discards_the_steps_after_the_checkpoint(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "steps.jsonl")
    log.group_start(0)
    log.step(1, [[10], [11]])
    log.step(2, [[12], [13]])
    log.step(3, [[14], []])
    log.group_start(2)  # crashed after step 3; rebuilt from the checkpoint of step 2: job 14 is lost
    log.step(3, [[14], [15]])
    log.step(4, [[16], []])
    counts = count_trained(tmp_path / "steps.jsonl")
    assert counts.times == {10: 1, 11: 1, 12: 1, 13: 1, 14: 1, 15: 1, 16: 1} and counts.group_starts == 2
    assert counts.count(scheduled=8) == {"trained_once": 7, "trained_twice": 0, "never_trained": 1}
    assert counts.count(scheduled=8, quarantined=1)["never_trained"] == 0


def test_double_training_shows(tmp_path: Path) -> None:
    """A job re-issued although it was inside the resumed weights appears twice in the lineage."""
    log = StepLog(tmp_path / "steps.jsonl")
    log.group_start(0)
    log.step(1, [[1]])
    log.step(2, [[2]])
    log.group_start(2)
    log.step(3, [[2]])
    log.step(4, [[3]])
    assert count_trained(tmp_path / "steps.jsonl").count(scheduled=3) == \
        {"trained_once": 2, "trained_twice": 1, "never_trained": 0}


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    StepLog(path).step(1, [[7]])
    with path.open("a") as f:
        f.write('{"rank": 0, "step": 2, "job_')
    assert count_trained(path).times == {7: 1}

