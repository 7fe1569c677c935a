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



# ---- fenced (issue 49's open item): a run that lost the folder adds nothing to the count -------------

def _two_holders(tmp_path: Path, monkeypatch) -> tuple[Path, dict, StepLog]:
    """Run A (token 1) trains steps 1-2 and has a checkpoint at 2; its driver pauses past its lease and run
    B (token 2) takes the folder over, resumes from step 2 and trains step 3 (jobs 5, 6). Returns (the
    log, A's token table, A's rank 0 step log)."""
    from app.run.lease import RunLease
    from app.storage import fence

    root, now, a_tables = tmp_path / "run", [1000.0], {}
    monkeypatch.setattr(fence, "_mine", a_tables)
    RunLease(root, 60, clock=lambda: now[0]).acquire()
    a = StepLog(root / "steps.jsonl")
    a.group_start(0)
    a.step(1, [[1], [2]])
    a.step(2, [[3], [4]])
    now[0] += 61
    monkeypatch.setattr(fence, "_mine", {})
    assert RunLease(root, 60, clock=lambda: now[0]).acquire().token == 2
    b = StepLog(root / "steps.jsonl")
    b.group_start(2)
    b.step(3, [[5], [6]])
    monkeypatch.setattr(fence, "_mine", a_tables)
    return root / "steps.jsonl", a_tables, a


def test_a_stale_rank_s_steps_after_a_takeover_are_not_counted(tmp_path: Path, monkeypatch) -> None:
    """A's rank 0 trains on after the takeover (steps 3 and 4, jobs 7-10) into the same steps.jsonl. Its
    rows are dropped, and the count is B's lineage: jobs 1-6 once, 7-10 never. Before: A's rows landed
    after B's group start and jobs 7-10 counted as trained."""
    path, _, a = _two_holders(tmp_path, monkeypatch)
    a.step(3, [[7], [8]])
    a.step(4, [[9], [10]])
    counts = count_trained(path)
    assert counts.times == {j: 1 for j in range(1, 7)} and counts.group_starts == 2
    assert counts.count(scheduled=10) == {"trained_once": 6, "trained_twice": 0, "never_trained": 4}
    assert len(path.read_text().splitlines()) == 1 + 4 + 1 + 2  # A's three records, B's two: nothing of A's after


def test_a_stale_row_that_slips_in_after_its_check_is_ignored(tmp_path: Path, monkeypatch) -> None:
    """A paused between its fence check and its append: its row lands after B's, carrying A's older token,
    and the replay ignores it. Before: rows carried no token and job 7 counted as trained at step 3."""
    from app.storage import fence

    path, _, a = _two_holders(tmp_path, monkeypatch)
    monkeypatch.setattr(fence, "lost", lambda root: False)  # the check A made just before the takeover
    a.step(3, [[7], [8]])
    assert len(path.read_text().splitlines()) == 10  # it landed
    assert count_trained(path).times == {j: 1 for j in range(1, 7)}


def test_hostile_lines_in_the_step_log_are_skipped(tmp_path: Path) -> None:
    """steps.jsonl is read from the checkpoint folder: a line of another shape is skipped, never a crash
    or a count. Before: KeyError / ValueError / TypeError out of count_trained."""
    path = tmp_path / "steps.jsonl"
    StepLog(path).step(1, [[7]])
    with path.open("a") as f:
        for bad in ('[]', '"x"', '{"step": "2", "job_ids": [8]}', '{"step": 2, "job_ids": "89"}', '{"step": 2}',
                    '{"step": 2, "job_ids": [8, "9"]}', '{"group_start": "0"}', '{"group_start": 0, "token": "9"}',
                    '{"step": true, "job_ids": [8]}'):
            f.write(bad + "\n")
    StepLog(path).step(3, [[11]])
    counts = count_trained(path)
    assert counts.times == {7: 1, 11: 1} and counts.group_starts == 0
