"""Several nodes on one machine: `ray.cluster_utils.Cluster` runs in a subprocess (tests/cluster_run.py),
so it never meets the session's shared Ray instance. Each node has its own CPUs, fake GPUs and object
store; the tiny run uses `topology.device=auto`, so bundles reserve GPUs and the actors compute on CPU. (The resume
at other topologies, 5/3 -> 3/2 and 6/4, runs on the session's one-node cluster: tests/test_e2e_ray.py.)

Trained jobs are counted from the step log (`logging.step_log`: the job ids of every optimizer step as the
ranks reported them, replayed by app/training/step_log.py), not from the pool's ledger.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import ROOT

# Each run is bounded by run_cluster's own timeout (1500 s); pytest-timeout's suite-wide 900 s would cut a
# slow box's run short instead of letting that bound speak, so these get 1800 s.
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(1800)]

# No learning checks beside tau (nothing here asserts them; tests/e2e_helpers.py FAST says why).
GPU_RUN = ["topology.device=auto", "topology.gpus_per_target=1", "topology.gpus_per_drafter=1",
           "train.epochs=2", "eval.num_prompts=2", "eval.max_new_tokens=16", "health.enabled=false",
           "logging.status_every_s=5", "logging.step_log=true", "supervision.stall_timeout_s=120"]


def run_cluster(run_dir: Path, nodes: list[dict], overrides: list[str], remove_node: dict | None = None,
                timeout_s: float = 1500, add_node: dict | None = None) -> dict:
    spec = {"run_dir": str(run_dir), "nodes": nodes, "overrides": overrides, "remove_node": remove_node,
            "timeout_s": timeout_s, "add_node": add_node}
    proc = subprocess.run([sys.executable, str(ROOT / "tests/cluster_run.py"), json.dumps(spec)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s + 180)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("CLUSTER_RESULT ")]
    assert lines, f"cluster_run.py gave no result (rc {proc.returncode}): {proc.stderr[-3000:]}"
    result = json.loads(lines[-1][len("CLUSTER_RESULT "):])
    result["driver_log"] = Path(result["log"]).read_text()
    keep = Path(tempfile.gettempdir()) / "dflash-cluster-logs"  # pytest's tmp dirs rotate away; keep the log
    keep.mkdir(exist_ok=True)
    shutil.copy(result["log"], keep / f"{run_dir.name}.driver.log")
    print(f"\n[{run_dir.name}] wall {result['wall_s']} s; events: {result['events']}; log {keep / run_dir.name}.driver.log")
    return result


def driver_lines(result: dict) -> str:
    """The driver's own lines (status, restarts, the failure), without Ray's actor noise."""
    lines = [l[:400] for l in result["driver_log"].splitlines()
             if l.startswith(("[dflash", "run failed", "config error", "RESULT", "Traceback"))]
    if result.get("ray_logs"):  # a failed run: why did Ray's processes die (memory monitor, signals)?
        import re

        pattern = re.compile(r"memory|OOM|SIGSEGV|SIGKILL|died|Killing", re.I)
        for f in sorted(Path(result["ray_logs"]).rglob("*")):
            if f.is_file() and f.suffix in (".out", ".err", ".log") and "core-worker" not in f.name:
                lines += [f"{f.name}: {l[:300]}" for l in f.read_text(errors="replace").splitlines()
                          if pattern.search(l)][:5]
        lines.append(f"Ray logs kept in {result['ray_logs']}")
    return "\n".join(lines)


def trained_counts(run_dir: Path, summary: dict) -> dict[str, int]:
    from app.training.step_log import FILE_NAME, count_trained

    return count_trained(run_dir / FILE_NAME).count(summary["jobs_scheduled"])


def test_losing_the_drafters_node_mid_run_completes_on_the_spare(tmp_path: Path) -> None:
    run_dir = tmp_path / "loss"
    # Head (driver, pool) + two 4-GPU nodes the 8 bundles fill under PACK + one spare 4-GPU node.
    nodes = [{"cpus": 1, "gpus": 0}, {"cpus": 2, "gpus": 4}, {"cpus": 2, "gpus": 4}, {"cpus": 2, "gpus": 4}]
    r = run_cluster(run_dir, nodes, [*GPU_RUN, "checkpoint.every_steps=2"],
                    remove_node={"drafter_bundle": 5, "after_checkpoint": True})
    log = r["driver_log"]
    assert r["rc"] == 0, driver_lines(r)
    assert any("remove node" in e for e in r["events"])
    s = r["summary"]
    counts = trained_counts(run_dir, s)
    assert counts["trained_twice"] == 0 and counts["never_trained"] == 0, counts
    assert s["jobs_acked"] == s["jobs_scheduled"] and s["jobs_acked_twice"] == 0
    assert "rebuilding the drafter group from" in log  # the drafters' node went away with them
    assert s["tau_trained"] is not None  # the final evaluation found a live target
    events = [l for l in log.splitlines() if "crashed" in l or "rebuild" in l or "restarted" in l or "lost" in l]
    print("\n".join(events[:20]))


def test_a_three_node_spread_run_shrinks_on_a_node_loss_and_grows_back_when_a_node_is_added(tmp_path: Path) -> None:
    """A head without GPUs and two 4-GPU nodes, 8 bundles SPREAD over them, no spare. First the spread
    itself: both GPU nodes hold bundles and the pool sits on the head. Losing one GPU node rebuilds a
    smaller drafter group (the lost node's GPUs cannot come back), which trains on. Then a node with the
    lost one's room joins: Ray re-places the lost bundles on it and the group grows back to its configured
    3 ranks at a checkpoint, each job trained once (counted from the step log, not from the pool's
    ledger) and the replicas identical at the end. One run for all three: the shrink half is the whole of
    what a no-spare run does until the node is added, and the spread is the start of it (the three-node
    run that only checked the spread is merged in here)."""
    import re

    from app.run.outputs.timeline import read_timeline

    run_dir = tmp_path / "grow"
    nodes = [{"cpus": 1, "gpus": 0}, {"cpus": 2, "gpus": 4}, {"cpus": 2, "gpus": 4}]
    # No node has room for the lost bundle until the test adds one, and the test adds it only once the group has
    # shrunk: the rebuild's wait for the bundle (supervision.bundle_wait_s, 90 s by default) is always waited out
    # here, so 10 s (CI waited the 90 s for nothing). The growth begins only once the placed-again bundle has held
    # for GROW_SETTLE_S (10 s) and the group reaches a step boundary; a fast box once finished the shrunk group's
    # ~42 steps in 13 s, before that. 1 s per drafter micro-batch keeps the shrunk group at work for 42 s or more
    # on any machine, so the growth is certain to come first.
    r = run_cluster(run_dir, nodes, [*GPU_RUN, "train.epochs=3", "eval.every_steps=0", "checkpoint.every_steps=2",
                                     "topology.strategy=SPREAD", "supervision.bundle_wait_s=10",
                                     "faults.drafter_delay_s=1.0"],
                    remove_node={"drafter_bundle": 5, "split_drafters": True, "drafter_bundles": [5, 6, 7],
                                 "after_checkpoint": True},
                    add_node={"cpus": 2, "gpus": 4, "after_log": "rebuilding the drafter group with"})
    log = r["driver_log"]
    assert r["rc"] == 0, driver_lines(r)
    events = [l for l in log.splitlines() if any(k in l for k in ("rebuild", "ranks", "grew", "grow", "again"))]
    print("\n".join(e[:300] for e in events[:20]))
    assert any("add node" in e for e in r["events"]), r["events"]
    where, removed = r["placements"][0], _removed(r)
    assert len(where) == 8 and set(where) == {1, 2}  # SPREAD: both GPU nodes hold bundles, the head none
    survivors = [b for b in (5, 6, 7) if where[b] != removed]
    assert 0 < len(survivors) < 3, where  # SPREAD over two nodes splits the three drafters
    assert f"rebuilding the drafter group with {len(survivors)} of 3 ranks" in log
    assert f"drafter group of {len(survivors)} ready" in log
    assert f"drafter group grew {len(survivors)} -> 3 of 3 ranks" in log
    s = r["summary"]
    assert s["growths"] == 1 and s["growth_history"][0]["done_size"] == 3, s.get("growth_history")
    rows = read_timeline(run_dir)
    (done,) = [row for row in rows if row["k"] == "grow_done"]
    assert (done["old"], done["new"], done["configured"]) == (len(survivors), 3, 3)
    shrunk_at = int(re.search(rf"drafter group of {len(survivors)} ready at step (\d+)", log).group(1))
    assert int(done["checkpoint"].split("-")[1]) > shrunk_at  # the smaller group trained before it grew
    at = rows.index(done)
    assert {row["rank"] for row in rows[at:] if row["k"] == "step"} == {0, 1, 2}  # the grown group trained
    # Continuous: the grown group's first loss is near the shrunk group's last ones, and nearer to them than to
    # a fresh start's (the run's first loss). Not "half the first loss": how far the loss has fallen when the
    # node joins depends on how fast this box runs the shrunk group (a CI run grew at step 17 with loss 4.2 of 7.0).
    before, after = ([row["loss"] for row in part if row["k"] == "step"] for part in (rows[:at], rows[at:]))
    last = sum(before[-3:]) / 3
    assert after[0] < 1.25 * last and abs(after[0] - last) < abs(after[0] - before[0]), (before[0], before[-3:], after[:3])
    counts = trained_counts(run_dir, s)
    assert counts == {"trained_once": s["jobs_scheduled"], "trained_twice": 0, "never_trained": 0}
    assert s["jobs_acked"] == s["jobs_scheduled"] > 0 and s["replicas_identical"] is True
    assert s["tau_trained"] is not None
    assert r["pool_node"] == 0  # on the head; pinned to the driver's node it once died with a worker node


def _removed(r: dict) -> int:
    return int(next(e for e in r["events"] if "remove node" in e).split("remove node ")[1].split()[0])
