"""One multi-node rehearsal in its own process: a `ray.cluster_utils.Cluster` (head + workers, each with
its own CPUs, fake GPUs and object store), the real driver submitted to it, optionally a worker node
removed mid-run and a node added later. Prints one `CLUSTER_RESULT {json}` line.

Run by tests/test_cluster_ray.py as a subprocess, so the cluster never meets the test session's shared
Ray instance: it has its own GCS port, temp dir, and does not write /tmp/ray/ray_current_cluster (which
would make every other `ray.init()` on the machine join it).

    python tests/cluster_run.py SPEC_JSON
    SPEC: {"run_dir": str, "nodes": [{"cpus": f, "gpus": f}, ...] (first = head),
           "overrides": [...], "timeout_s": f,
           "remove_node": {"drafter_bundle": i, "after_checkpoint": bool, "split_drafters": bool,
                           "drafter_bundles": [i, ...]} | null (see _victim),
           "add_node": {"cpus": f, "gpus": f, "after_log": str} | null (added once the node removal is
                       done and the driver's log holds `after_log`)
          }
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_ports(n: int) -> list[int]:
    """n distinct ports the OS reports free. All n sockets stay bound until every port is read: a port
    released and asked for again may come back, and two Ray components given one port refuse to start."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start_cluster(nodes: list[dict], temp_dir: str):
    import ray._private.utils
    from ray.cluster_utils import Cluster

    ray._private.utils.write_ray_address = lambda *a, **k: None  # keep other ray.init() calls off this cluster
    head, *workers = nodes
    free = iter(_free_ports(2 + len(NODE_PORTS) * len(nodes)))  # every port of the cluster in one draw: none repeats
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=head["cpus"], num_gpus=head.get("gpus", 0), gcs_server_port=next(free), temp_dir=temp_dir,
        ray_client_server_port=next(free), **_node_ports(free), **NODE_ARGS))
    handles = [cluster.head_node]
    for w in workers:
        handles.append(cluster.add_node(num_cpus=w["cpus"], num_gpus=w.get("gpus", 0), **_node_ports(free),
                                        **NODE_ARGS))
    cluster.wait_for_nodes()
    return cluster, handles


NODE_ARGS = dict(object_store_memory=150 * 1024 * 1024, include_dashboard=False)
NODE_PORTS = ("dashboard_agent_listen_port", "metrics_export_port", "runtime_env_agent_port")


def _node_ports(free=None) -> dict:
    """Each of a node's ports from `free` (default: a draw of its own). No fixed default port: another Ray on this
    machine may hold it."""
    free = free if free is not None else iter(_free_ports(len(NODE_PORTS)))
    return {key: next(free) for key in NODE_PORTS}


def bundle_nodes(node_ids: list[str]) -> list[int]:
    """Node index (into `node_ids`, head = 0) of each bundle of the run's placement group, [] if none yet."""
    import ray

    for pg in ray.util.placement_group_table().values():
        if pg.get("name", "").startswith("dflash-") and pg.get("state") == "CREATED":
            where = pg.get("bundles_to_node_id", {})
            return [node_ids.index(where[i]) if where.get(i) in node_ids else -1 for i in sorted(where)]
    return []


def main(spec: dict) -> dict:
    run_dir = Path(spec["run_dir"])
    temp_dir = f"/tmp/rc{os.getpid()}"
    cluster, nodes = start_cluster(spec["nodes"], temp_dir)
    node_ids = [n.node_id for n in nodes]
    import ray

    ray.init(address=cluster.address, configure_logging=False, log_to_driver=False)  # to read the PG table
    env = dict(os.environ, RAY_ADDRESS=cluster.address, PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled")
    log_path = run_dir.parent / f"{run_dir.name}.driver.log"
    t0 = time.monotonic()
    events: list[str] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.train", "--config", "conf/tiny.yaml", f"checkpoint.dir={run_dir}",
             f"tiny.cache_dir={ROOT / '.cache/tiny'}", *spec["overrides"]],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        removal, addition = spec.get("remove_node"), spec.get("add_node")
        deadline = t0 + spec.get("timeout_s", 900)
        placements: list[list[int]] = []
        pool_node: int | None = None
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1.0)
            if pool_node is None:
                pool_node = _pool_node(node_ids)
            now = bundle_nodes(node_ids)
            if now and (not placements or now != placements[-1]):
                placements.append(now)
                events.append(f"{time.monotonic() - t0:.1f}s bundles on nodes {now}")
            if removal and placements and _ready_to_remove(run_dir, log_path, removal):
                index = _victim(placements[-1], removal)
                events.append(f"{time.monotonic() - t0:.1f}s remove node {index} ({node_ids[index][:8]})")
                cluster.remove_node(nodes[index], allow_graceful=False)
                removal = None
            if addition and removal is None and addition["after_log"] in log_path.read_text():
                nodes.append(cluster.add_node(num_cpus=addition["cpus"], num_gpus=addition.get("gpus", 0),
                                              **_node_ports(), **NODE_ARGS))
                node_ids.append(nodes[-1].node_id)
                events.append(f"{time.monotonic() - t0:.1f}s add node {len(nodes) - 1} ({node_ids[-1][:8]})")
                addition = None
        if proc.poll() is None:
            proc.kill()
            events.append("driver timed out")
        rc = proc.wait()
    wall = time.monotonic() - t0
    summary_path = run_dir / "summary.json"
    ray.shutdown()
    result = {"rc": rc, "wall_s": round(wall, 1), "events": events, "placements": placements, "pool_node": pool_node,
              "summary": json.loads(summary_path.read_text()) if summary_path.exists() else None,
              "log": str(log_path)}
    cluster.shutdown()
    import shutil

    if rc != 0:  # keep the nodes' logs of a failed run beside its driver log (a dead actor says why there)
        for logs in Path(temp_dir).glob("session_*/logs"):
            shutil.copytree(logs, run_dir.parent / f"{run_dir.name}.ray-logs" / logs.parent.name,
                            ignore=shutil.ignore_patterns("*.sock"), dirs_exist_ok=True)
        result["ray_logs"] = str(run_dir.parent / f"{run_dir.name}.ray-logs")
    shutil.rmtree(temp_dir, ignore_errors=True)  # the nodes' session folders (logs, sockets, spilled objects)
    return result


def _pool_node(node_ids: list[str]) -> int | None:
    """Node index of the run's live pool actor, None before it exists (the GCS actor table)."""
    import ray._private.state as ray_state  # the public state API needs the dashboard

    for a in ray_state.actors().values():
        if a.get("ActorClassName") == "HSPoolActor" and a.get("State") == "ALIVE":
            node = (a.get("Address") or {}).get("NodeID")
            return node_ids.index(node) if node in node_ids else None
    return None


def _victim(where: list[int], removal: dict) -> int:
    """The node to remove: the one holding bundle `drafter_bundle`; with `split_drafters`, a node holding
    some but not all of the drafter bundles (so the group can only come back smaller), if there is one."""
    if removal.get("split_drafters"):
        drafter_nodes = [where[b] for b in removal["drafter_bundles"]]
        for node in sorted(set(drafter_nodes)):
            if 0 < drafter_nodes.count(node) < len(drafter_nodes):
                return node
    return where[removal["drafter_bundle"]]


def _ready_to_remove(run_dir: Path, log_path: Path, removal: dict) -> bool:
    """Remove the node once training is under way: a checkpoint exists (and a few steps went by)."""
    if removal.get("after_checkpoint", True):
        return any(p.name.startswith("ckpt-") for p in run_dir.glob("ckpt-*"))
    return "drafter group of" in log_path.read_text()


if __name__ == "__main__":
    out = main(json.loads(sys.argv[1]))
    print("CLUSTER_RESULT " + json.dumps(out), flush=True)
