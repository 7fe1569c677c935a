"""End to end on the tiny config: the real driver, 5 targets and 3 drafters on the local cluster."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.training.checkpoint import latest_checkpoint, read_ledger
from tests.e2e_helpers import (assert_finished, run_drivers_together, sigterm_and_wait, start_driver, summary,
                               trained_counts, wait_for)

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_tiny_run_trains_every_job_exactly_once(reference_run) -> None:
    # The session's reference run (tests/e2e_helpers.py REFERENCE): the tiny default, 6 epochs, so tau is
    # meaningful; wandb offline, whose file is read back below (issue 25).
    assert_finished(reference_run)
    tmp_path = reference_run.run_dir
    s = summary(tmp_path)
    out = reference_run.out
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
    from app.run.outputs.wandb_log import STEP_KEYS, read_history

    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    rows = [r for r in read_history(run_file) if "event" not in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(set(STEP_KEYS) | {"acc_pos1"} <= set(r) for r in rows), rows[0]


def _last_status_loss(out: str) -> float:
    import re

    losses = [float(m) for m in re.findall(r"\| loss (\d+\.\d+) ", out) if float(m) > 0]
    assert losses, out[-2000:]
    return losses[-1]


def test_stop_then_resume_with_other_topologies_trains_each_job_once(ray_cluster, tmp_path: Path) -> None:
    """A driver stopped by SIGTERM at 2 targets / 3 drafters, resumed as 1/2 and (from a copy) as 3/4, the two
    resumes at once: the stop ends cleanly with its wandb history, the resumes read the data cache the first run
    wrote, every job is trained once across both halves, and the loss goes on from where it stopped (the LR
    schedule runs on jobs consumed, which does not depend on the topology). One stop for two checks that used to
    stop a run each: the local stop -> resume and the elastic resume, to fewer and to more of each side. (It was
    5/3 -> 3/2 and 6/4, one resume after the other: 23 actor starts, now 15, and the resumes overlap.)"""
    import shutil

    from app.run.outputs.wandb_log import read_history

    first = tmp_path / "elastic"
    # The drafter delay keeps the first driver training for at least 1 s a step whatever the machine's speed
    # (~23 steps): the SIGTERM certainly lands mid-run, a few steps after the checkpoint it waits for.
    proc = start_driver(first, "topology.num_targets=2", "topology.num_drafters=3", "checkpoint.every_steps=2",
                        "logging.wandb_mode=offline", "faults.drafter_delay_s=1")
    wait_for(lambda: latest_checkpoint(first) is not None and read_ledger(latest_checkpoint(first))[0] >= 4,
             900, "a checkpoint at step >= 4")  # a bound, not a speed claim
    code, out = sigterm_and_wait(proc, timeout=300)
    assert code == 0 and "stopped cleanly" in out, out[-3000:]
    assert "data: tokenized" in out and "data: loaded" not in out  # the first run tokenized and cached
    step, _, ledger = read_ledger(latest_checkpoint(first))
    assert step >= 4 and ledger
    # The stopped driver ended its wandb run: its history holds every step up to the stop's checkpoint.
    (run_file,) = (first / "wandb").glob("offline-run-*/run-*.wandb")
    assert [r["step"] for r in read_history(run_file) if "event" not in r] == list(range(1, step + 1))
    loss_at_stop = _last_status_loss(out)
    copy = tmp_path / "elastic-34"
    shutil.copytree(first, copy)

    resumes = {(1, 2): first, (3, 4): copy}
    done = run_drivers_together({f"{t}/{d}": (run_dir, [f"topology.num_targets={t}", f"topology.num_drafters={d}"])
                                 for (t, d), run_dir in resumes.items()}, timeout=1500)
    for (targets, drafters), run_dir in resumes.items():
        code, log = done[f"{targets}/{drafters}"]
        assert code == 0, log[-3000:]
        assert "data: loaded" in log and "data: tokenized" not in log  # the resume memory-maps the cache
        s = summary(run_dir)
        counts = trained_counts(run_dir)
        print(f"\n[{targets}/{drafters}] resumed at step {step} ({len(ledger)} jobs); loss at stop {loss_at_stop:.3f}, "
              f"first after resume {s['loss_first']:.3f}, last {s['loss_last']:.3f}; counts {counts}")
        # From the step log of both drivers: each job in the final weights' lineage exactly once.
        assert counts == {"trained_once": s["jobs_scheduled"], "trained_twice": 0, "never_trained": 0}
        assert s["resumed_from_step"] == step
        assert s["jobs_acked"] == s["jobs_scheduled"] and s["jobs_acked_twice"] == 0
        assert s["jobs_trained_this_run"] == s["jobs_scheduled"] - len(ledger)
        assert set(ledger) <= set(read_ledger(latest_checkpoint(run_dir))[2])
        # Continuous: the first loss after the resume is near the loss at the stop, far below a fresh start's.
        assert s["loss_first"] < loss_at_stop * 1.25 and s["loss_last"] < s["loss_first"] * 1.1
