"""Supervision on the tiny config: each fault is survived, and the ledger holds every job once."""
from __future__ import annotations

from pathlib import Path

import pytest

from app.training.checkpoint import latest_checkpoint, read_ledger
from tests.e2e_helpers import final_weights_finite, run_in_process, summary

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _assert_complete(run_dir: Path) -> dict:
    s = summary(run_dir)
    assert s["jobs_acked"] == s["jobs_scheduled"] > 0
    assert s["jobs_acked_twice"] == 0
    ledger = read_ledger(latest_checkpoint(run_dir))[2]
    assert len(ledger) == len(set(ledger)) == s["jobs_scheduled"]
    assert final_weights_finite(run_dir)
    return s


def test_target_crash_is_requeued_and_restarted(ray_cluster, tmp_path: Path, capsys) -> None:
    assert run_in_process(tmp_path, "faults.kill_target_at_job=3") == 0
    s = _assert_complete(tmp_path)
    out = capsys.readouterr().out
    assert s["faults"] >= 1 and s["restarts"] >= 1
    assert "crashed" in out and "restarted (1/" in out


def test_drafter_crash_rebuilds_the_group_from_the_checkpoint(ray_cluster, tmp_path: Path, capsys) -> None:
    assert run_in_process(tmp_path, "faults.kill_drafter_at_step=5", "checkpoint.every_steps=2") == 0
    s = _assert_complete(tmp_path)
    out = capsys.readouterr().out
    assert s["restarts"] >= 1
    assert "rebuilding the drafter group from" in out and "ckpt-00000004" in out


def test_stalled_target_is_killed_by_the_watchdog(ray_cluster, tmp_path: Path, capsys) -> None:
    assert run_in_process(tmp_path, "faults.stall_target_at_job=2", "supervision.stall_timeout_s=6") == 0
    _assert_complete(tmp_path)
    out = capsys.readouterr().out
    assert "watchdog: target" in out and "killing it" in out


def test_no_restart_budget_fails_with_one_line(ray_cluster, tmp_path: Path, capsys) -> None:
    assert run_in_process(tmp_path, "faults.kill_target_at_job=2", "supervision.max_restarts_target=0") == 1
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("run failed:")]
    assert len(lines) == 1
    assert "TargetActor" in lines[0] and "supervision.max_restarts_target" in lines[0]


def test_pool_crash_stops_the_run_and_the_next_start_resumes(ray_cluster, tmp_path: Path, capsys) -> None:
    import threading

    import ray

    from tests.e2e_helpers import wait_for

    code: dict[str, int] = {}
    worker = threading.Thread(target=lambda: code.update(first=run_in_process(tmp_path, "checkpoint.every_steps=2")))
    worker.start()
    wait_for(lambda: latest_checkpoint(tmp_path) is not None, 240, "a first checkpoint")
    ray.kill(ray.get_actor(f"dflash-pool-{tmp_path.name}"), no_restart=True)
    worker.join(timeout=180)
    assert code["first"] == 1
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("run failed:")]
    assert len(lines) == 1 and "pool actor HSPoolActor died" in lines[0] and "ckpt-" in lines[0]
    step, _, ledger = read_ledger(latest_checkpoint(tmp_path))

    assert run_in_process(tmp_path) == 0
    s = _assert_complete(tmp_path)
    assert s["resumed_from_step"] >= step and s["jobs_trained_this_run"] <= s["jobs_scheduled"] - len(ledger)
