"""Helpers for the end-to-end Ray tests: run the real driver on the tiny config."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import ROOT


# The tiny config, shortened for tests: two epochs, tau on four prompts, no end-of-run speed race and no learning
# checks beside each tau (no Ray test asserts either; the reference run keeps both, so one real run goes through
# them; without the checks a 2/2 one-epoch run went from its last step to its tau in 21 s instead of 27 s, at load
# 18). The tiny target's own settings stay as in conf/tiny.yaml so the demo and the tests share one cached build.
FAST = ["train.epochs=2", "eval.num_prompts=4", "eval.max_new_tokens=32", "eval.race_prompts=0",
        "health.enabled=false", "logging.status_every_s=2", "checkpoint.every_steps=4",
        "supervision.stall_timeout_s=30", "logging.step_log=true"]

# A fault that fires in epoch 0 shows on one epoch at 2 targets / 2 drafters (34 jobs, 17 steps, five actor
# processes) as well as on the tiny default's 5 / 3, at about half the actor starts and a quarter of the jobs.
SMALL = ["topology.num_targets=2", "topology.num_drafters=2", "train.epochs=1"]


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


# The shared reference run (conftest.py's session fixture `reference_run`): the tiny default (5 targets / 3
# drafters) for 6 epochs, wandb offline, an evaluation (with the learning checks) offered every 10 steps, the
# end-of-run speed race, and the node's Prometheus endpoint scraped every second while it trains. test_e2e_ray
# (every job once, tau, exports, wandb rows), test_run_outputs_ray (tau during the run, drafter-best/, the report)
# and test_metrics_ray (every metric, no bucket piling up) all assert on this one run. The drafter delay is a floor
# under the training's length whatever the machine's speed (~68 steps x 0.25 s): the scrapes see many export
# rounds (2 s) and the timeline many pool rows (every 2 s), and the 10-step evaluations have time to land.
REFERENCE = ["train.epochs=6", "logging.wandb_mode=offline", "eval.every_steps=10", "faults.drafter_delay_s=0.25",
             "eval.race_prompts=4", "health.enabled=true"]


@dataclass
class ReferenceRun:
    run_dir: Path
    run_label: str  # the `run` label of its metrics
    code: int | None  # the driver's exit code; None if it raised (error holds why)
    out: str = field(repr=False)  # the driver's stdout (status lines, RESULT)
    err: str = field(repr=False)
    scrapes: list[str] = field(repr=False)  # each scrape's metric lines of this run, in order
    error: str = field(default="", repr=False)


def reference_run(run_dir: Path, scrape_every_s: float = 1.0) -> ReferenceRun:
    """Run REFERENCE in a thread on the session's cluster, scraping the metrics endpoint meanwhile."""
    import contextlib
    import io
    import threading
    import traceback
    import urllib.request

    import ray

    from app.config.load import load_config
    from app.run.plan import run_name

    label = run_name(load_config(ROOT / "conf/tiny.yaml", tiny_overrides(run_dir, *REFERENCE)))
    port = ray._private.worker.global_worker.node.metrics_export_port
    out, err, result = io.StringIO(), io.StringIO(), {}

    def work() -> None:
        try:
            result["code"] = run_in_process(run_dir, *REFERENCE)
        except BaseException:  # noqa: BLE001 - every test of the run reports it
            result["error"] = traceback.format_exc()

    scrapes = []
    old_silent = os.environ.get("WANDB_SILENT")
    os.environ["WANDB_SILENT"] = "true"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            worker = threading.Thread(target=work, daemon=True)
            worker.start()
            while worker.is_alive():
                try:
                    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
                except OSError as exc:  # one lost scrape is not the run's failure; the metrics test counts them
                    text = f"# scrape failed: {exc}"
                scrapes.append("\n".join(line for line in text.splitlines() if f'run="{label}"' in line))
                worker.join(scrape_every_s)
            import wandb

            wandb.teardown()  # the service writes the offline run file after finish() returns: wait for it
    finally:
        if old_silent is None:
            os.environ.pop("WANDB_SILENT", None)
        else:
            os.environ["WANDB_SILENT"] = old_silent
    return ReferenceRun(run_dir, label, result.get("code"), out.getvalue(), err.getvalue(), scrapes,
                        result.get("error", ""))


def assert_finished(run: ReferenceRun) -> None:
    """The reference run exited 0 (each test that reads it says so first, with the driver's own words)."""
    assert run.code == 0, (run.error or run.err[-3000:]) + run.out[-3000:]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def trained_counts(run_dir: Path) -> dict[str, int]:
    """trained_once / trained_twice / never_trained from the step log (the job ids the ranks reported
    per optimizer step), independent of the pool's ledger."""
    from app.training.step_log import FILE_NAME, count_trained

    s = summary(run_dir)
    return count_trained(run_dir / FILE_NAME).count(s["jobs_scheduled"], s.get("jobs_quarantined") or 0)


def start_driver(run_dir: Path, *extra: str, log=subprocess.PIPE) -> subprocess.Popen:
    """The driver as its own process, joined to the session's cluster through RAY_ADDRESS; its output
    goes to a pipe, or to `log` (an open file)."""
    import ray

    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "app.train", "--config", "conf/tiny.yaml", *tiny_overrides(run_dir, *extra)],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
    )


def run_drivers_together(runs: dict[str, tuple[Path, list[str]]], timeout: float) -> dict[str, tuple[int, str]]:
    """Several drivers at once on the session's cluster, each its own process: {name: (exit code, output)}.
    For runs whose length is mostly injected delays (sleeps), which then overlap instead of adding up."""
    procs, logs = {}, {}
    for name, (run_dir, extra) in runs.items():
        logs[name] = run_dir.parent / f"{run_dir.name}.driver.log"
        logs[name].parent.mkdir(parents=True, exist_ok=True)
        with logs[name].open("w") as log:
            procs[name] = start_driver(run_dir, *extra, log=log)
    deadline = time.monotonic() + timeout
    results = {}
    for name, proc in procs.items():
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        results[name] = (proc.returncode, logs[name].read_text())
    return results


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
