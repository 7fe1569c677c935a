"""Helpers for the end-to-end Ray tests: run the real driver on the tiny config."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The tiny config, shortened for tests: two epochs, tau on four prompts. The tiny target's own
# settings stay as in conf/tiny.yaml so the demo and the tests share one cached build.
FAST = ["train.epochs=2", "eval.num_prompts=4", "eval.max_new_tokens=32", "logging.status_every_s=2",
        "checkpoint.every_steps=4", "supervision.stall_timeout_s=30", "logging.step_log=true"]


def tiny_overrides(run_dir: Path, *extra: str) -> list[str]:
    return [f"checkpoint.dir={run_dir}", f"tiny.cache_dir={ROOT / '.cache/tiny'}", *FAST, *extra]


def kill_pool() -> int:
    """SIGKILL the run's live pool actor (it has no name to look it up by); returns its pid."""
    from app.bench.runs.chaos import live_actor_pids

    pids = live_actor_pids("HSPoolActor")
    assert len(pids) == 1, f"expected one live pool actor, found pids {pids}"
    os.kill(pids[0], signal.SIGKILL)
    return pids[0]


def named_actors() -> list[str]:
    """Every named actor in every namespace of the cluster (a run must add none)."""
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]


def run_in_process(run_dir: Path, *extra: str) -> int:
    """The driver in this process, on the session's Ray cluster (already initialised)."""
    from app.config.load import load_config
    from app.run.driver import run

    cfg = load_config(ROOT / "conf/tiny.yaml", tiny_overrides(run_dir, *extra))
    return run(cfg)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def trained_counts(run_dir: Path) -> dict[str, int]:
    """trained_once / trained_twice / never_trained from the step log (the job ids the ranks reported
    per optimizer step), independent of the pool's ledger."""
    from app.training.step_log import FILE_NAME, count_trained

    s = summary(run_dir)
    return count_trained(run_dir / FILE_NAME).count(s["jobs_scheduled"], s.get("jobs_quarantined") or 0)


def start_driver(run_dir: Path, *extra: str) -> subprocess.Popen:
    """The driver as its own process, joined to the session's cluster through RAY_ADDRESS."""
    import ray

    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "app.train", "--config", "conf/tiny.yaml", *tiny_overrides(run_dir, *extra)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def sigterm_and_wait(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def final_weights_finite(run_dir: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(run_dir / "drafter" / "model.safetensors"))
    return all(torch.isfinite(t).all() for t in weights.values())
