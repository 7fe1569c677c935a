"""End to end on the tiny config: the real driver, 5 targets and 3 drafters on the local cluster."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.training.checkpoint import latest_checkpoint, read_ledger
from tests.e2e_helpers import run_in_process, sigterm_and_wait, start_driver, summary, trained_counts, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_tiny_run_trains_every_job_exactly_once(ray_cluster, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    # the tiny default: tau is meaningful there; wandb offline, whose file is read back below (issue 25)
    assert run_in_process(tmp_path, "train.epochs=6", "logging.wandb_mode=offline") == 0
    s = summary(tmp_path)
    out = capsys.readouterr().out
    assert s["jobs_acked"] == s["jobs_scheduled"] > 0
    assert s["jobs_acked_twice"] == 0
    assert s["loss_last"] < s["loss_first"]
    assert s["replicas_identical"] is True
    assert s["tau_trained"] > s["tau_untrained"] + 1  # the drafter learned to draft
    assert "q_hsb=[" in out and "bottleneck:" in out and "RESULT " in out
    assert trained_counts(tmp_path) == {"trained_once": s["jobs_scheduled"], "trained_twice": 0, "never_trained": 0}
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    # drafter-best/ (written by the evaluating target, which computes in fp32 on CPU) is what a user may
    # serve too: it is exported in checkpoint.export_dtype like drafter/.
    best = json.loads((tmp_path / "drafter-best" / "config.json").read_text())
    assert config["dtype"] == best["dtype"] == "bfloat16"
    _assert_one_wandb_row_per_step(tmp_path, s["steps"])


def _assert_one_wandb_row_per_step(run_dir: Path, steps: int) -> None:
    """The run's offline wandb file, read back: one history row per optimizer step with the listed keys."""
    import wandb

    from app.run.outputs.wandb_log import STEP_KEYS, read_history

    wandb.teardown()  # the service writes the run file after finish() returns: wait for it to end
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    rows = [r for r in read_history(run_file) if "event" not in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(set(STEP_KEYS) | {"acc_pos1"} <= set(r) for r in rows), rows[0]


def test_stop_then_resume_trains_each_job_once(ray_cluster, tmp_path: Path, capsys) -> None:
    proc = start_driver(tmp_path, "checkpoint.every_steps=2", "logging.wandb_mode=offline")
    wait_for(lambda: latest_checkpoint(tmp_path) is not None, 900, "a first checkpoint")  # a bound, not a speed claim
    code, out = sigterm_and_wait(proc, timeout=120)
    assert code == 0, out
    assert "stopped cleanly" in out
    assert "data: tokenized" in out and "data: loaded" not in out  # the first run tokenized and cached
    step1, _, ledger1 = read_ledger(latest_checkpoint(tmp_path))
    assert step1 > 0 and ledger1
    # The stopped driver ended its wandb run: its history holds every step up to the stop's checkpoint.
    from app.run.outputs.wandb_log import read_history

    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert [r["step"] for r in read_history(run_file) if "event" not in r] == list(range(1, step1 + 1))

    assert run_in_process(tmp_path) == 0
    log = capsys.readouterr().out
    assert "data: loaded" in log and "data: tokenized" not in log  # the resume memory-maps the cache
    s = summary(tmp_path)
    assert s["resumed_from_step"] == step1
    assert s["jobs_acked"] == s["jobs_scheduled"] and s["jobs_acked_twice"] == 0
    assert set(ledger1) <= set(read_ledger(latest_checkpoint(tmp_path))[2])
    # From the step log of both drivers: each job in the final weights' lineage exactly once.
    assert trained_counts(tmp_path) == {"trained_once": s["jobs_scheduled"], "trained_twice": 0, "never_trained": 0}
