"""Every check made before an actor starts, in the order the driver makes them (app/run/driver.py `run`).

A mistake is one `ConfigError`/`DataError` line and exit 2, before the cluster waits on anything:
1. before the lease: a relative `checkpoint.dir` on an existing cluster (`check_dir_shared`, here);
2. while planning, before `ray.init` (app/run/plan.py `plan_run`): the target against the config
   (app/config/checks.py `check_target`), the data, and the resume point (same data, same schedule);
3. against the cluster, once connected (`preflight`, here): resources (app/config/checks.py
   `check_resources`), bundles per node (app/run/placement.py `check_cluster_fits`), the runs of a sweep
   planned (app/run/sweep.py `plan_runs`; their layers were checked in step 2), one global step of the largest job within
   the pool's budget (`RunPlan.use_device`, sized for every layer the targets capture: a sweep's union), and
   the object store (app/pool/holdings.py `check_object_store`).
The check functions stay beside what they check; this module says which run, and when.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from app.config.checks import check_resources
from app.config.errors import ConfigError
from app.config.schema import Config
from app.pool.holdings import check_object_store
from app.storage.roots import is_uri


@dataclass(frozen=True)
class Cluster:
    """What Ray says about the cluster, read once after connecting."""

    resources: dict[str, float]  # ray.cluster_resources(): CPU, GPU, memory, object_store_memory, ...
    nodes: list[dict[str, Any]]  # ray.nodes()
    use_gpu: bool  # topology.device, or auto: whether the cluster has GPUs

    @property
    def object_store_bytes(self) -> float:
        """The object store, all nodes together (0 when Ray does not say)."""
        return float(self.resources.get("object_store_memory", 0.0))


def read_cluster(cfg: Config) -> Cluster:
    import ray

    from app.run.topology import uses_gpu

    resources = ray.cluster_resources()
    return Cluster(resources, ray.nodes(), uses_gpu(cfg.topology, resources.get("GPU", 0.0)))


def check_dir_shared(cfg: Config) -> None:
    """A relative checkpoint.dir on an existing cluster (`ray job submit`) resolves in each node's own
    working-dir copy: the driver and rank 0 would write different folders. Refuse it."""
    address = os.environ.get("RAY_ADDRESS", "")
    if address and address != "local" and not is_uri(cfg.checkpoint.dir) and not os.path.isabs(cfg.checkpoint.dir):
        raise ConfigError(f"checkpoint.dir={cfg.checkpoint.dir!r} is relative, and this driver joins the cluster at "
                          "RAY_ADDRESS: every node would resolve it in its own copy of the working dir. Use an "
                          "absolute path on a volume every node mounts, or an s3:// URI")


def preflight(plan, cluster: Cluster) -> dict:
    """The checks against the cluster, in order; returns the stream's runs by name (`plan_runs`: a single
    run is `{"": plan}`). `plan` carries the config (`plan.cfg`) and sizes the jobs for the device."""
    from app.run.placement import check_cluster_fits
    from app.run.plan import object_store_extras
    from app.run.sweep import plan_runs

    cfg = plan.cfg
    check_resources(cfg, cluster.resources, cluster.use_gpu)
    check_cluster_fits(cfg, cluster.use_gpu, cluster.nodes)  # per node: names what is short where
    runs = plan_runs(plan)  # a sweep: the targets capture the union of its runs' layers, which sizes a job
    plan.use_device(cluster.use_gpu)  # one global step of the largest job fits the pool's byte budget
    for run in runs.values():
        run.bytes_per_token = plan.bytes_per_token  # the payload a run's ranks fetch is the stream's
    store = cluster.object_store_bytes
    extras = object_store_extras(plan) if store else (0, 0)  # Ray did not say: nothing to compare with
    check_object_store(cfg, plan.jobs.max_payload_bytes(), store, *extras)  # the dataset and eval offers too
    return runs
