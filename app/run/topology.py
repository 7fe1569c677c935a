"""The run's Ray topology: one placement group, a bundle per actor (targets first, then drafters).

Actors are plain classes made remote here, with resources from the `topology` section; each one
is pinned to its bundle, so a restarted actor lands exactly where its predecessor was.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.config.checks import actor_bundles
from app.config.schema import Config, TopologyConfig

# The custom resource Ray puts on the head node only.
HEAD_NODE_RESOURCE = "node:__internal_head__"


@dataclass(frozen=True)
class BundlePlan:
    """Bundles of the placement group and which actor sits in which."""

    bundles: list[dict[str, float]]
    num_targets: int
    num_drafters: int
    use_gpu: bool

    def target_bundle(self, i: int) -> int:
        return i

    def drafter_bundle(self, rank: int) -> int:
        return self.num_targets + rank


def plan_bundles(topo: TopologyConfig, use_gpu: bool) -> BundlePlan:
    """One bundle per actor (`actor_bundles`: GPUs when the run uses them, CPU shares always)."""
    return BundlePlan(actor_bundles(topo, use_gpu), topo.num_targets, topo.num_drafters, use_gpu)


def uses_gpu(topo: TopologyConfig, cluster_gpus: float) -> bool:
    """`device=auto` means GPUs when the cluster has any; `cpu` never; `cuda` always."""
    if topo.device == "cpu":
        return False
    return topo.device == "cuda" or cluster_gpus > 0


class Topology:
    """Creates (and re-creates) the run's actors inside its placement group."""

    def __init__(self, cfg: Config, plan: BundlePlan, run_name: str) -> None:
        from ray.util.placement_group import placement_group, remove_placement_group

        from app.config.errors import ConfigError
        from app.run.placement import wait_placement

        self.cfg, self.plan, self.run_name = cfg, plan, run_name
        # Which bundle each actor sits in: targets first, then drafters, until a re-split moves a
        # bundle to the other role (app/run/elastic/resplit.py): the placement group itself never changes.
        self.target_bundles: dict[int, int] = {i: plan.target_bundle(i) for i in range(plan.num_targets)}
        self.drafter_bundles: list[int] = [plan.drafter_bundle(r) for r in range(plan.num_drafters)]
        self.pg = placement_group(plan.bundles, strategy=cfg.topology.strategy, name=f"dflash-{run_name}")
        # Extra bundles (topology.max_extra_gpus, app/run/elastic/extra_shell.py): one single-bundle placement
        # group each; a bundle index past the main group's names (that group, its bundle 0).
        self.extra: dict[int, tuple[Any, dict[str, float]]] = {}
        try:
            wait_placement(self.pg, plan.bundles)  # past its timeout: one line (ConfigError), exit 2
        except ConfigError:
            remove_placement_group(self.pg)  # a pending group would keep its claim on the cluster
            raise

    def target_bundle(self, target_id: int) -> int:
        """The bundle target slot `target_id` sits in."""
        return self.target_bundles[target_id]

    def shape(self, bundle: int) -> dict[str, float]:
        """The resources of bundle index `bundle` (the main group's, or an extra one's)."""
        return self.extra[bundle][1] if bundle in self.extra else self.plan.bundles[bundle]

    def add_extra(self, pg: Any, shape: dict[str, float]) -> int:
        """Register an extra single-bundle placement group; its bundle index (removed with the others)."""
        index = len(self.plan.bundles) + len(self.extra)
        while index in self.extra:
            index += 1
        self.extra[index] = (pg, dict(shape))
        return index

    def drop_extra(self, bundle: int) -> None:
        """An extra group not placed in time: removed (a pending group keeps its claim on the cluster)."""
        from ray.util.placement_group import remove_placement_group

        pg, _ = self.extra.pop(bundle)
        remove_placement_group(pg)

    def strategy(self, bundle: int) -> Any:
        """The scheduling strategy that pins a task or actor to bundle index `bundle`."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if bundle in self.extra:
            return PlacementGroupSchedulingStrategy(placement_group=self.extra[bundle][0],
                                                    placement_group_bundle_index=0)
        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=bundle)


    @staticmethod
    def _pool_node() -> Any:
        """The head node, else the driver's: the pool then shares the fate of the GCS, whose loss ends
        the cluster anyway, so losing any worker node never loses the pool. Hard affinity: a soft one
        was seen placing the pool on a worker node although the head was alive and had room (the
        pool takes no CPU), and a removed worker node then took the pool down with it."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        head = next((n["NodeID"] for n in ray.nodes()
                     if n.get("Alive") and HEAD_NODE_RESOURCE in n.get("Resources", {})), None)
        return NodeAffinitySchedulingStrategy(node_id=head or ray.get_runtime_context().get_node_id(), soft=False)

    def wait_bundles(self, bundles: list[int], timeout_s: float) -> list[int]:
        """Wait until each bundle sits on a live node again; returns those that did not within `timeout_s`.

        When a node is lost, Ray re-places its bundles on nodes with room, but only once the GCS has
        noticed the death (seconds later); an actor created into such a bundle before that is cancelled.
        A resource-free probe task per bundle runs as soon as the bundle is placed on a live node."""
        import ray

        probe = ray.remote(num_cpus=0, max_retries=-1)(bundle_probe)
        refs = {b: probe.options(scheduling_strategy=self.strategy(b)).remote() for b in bundles}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        return [b for b, ref in refs.items() if ref not in ready]

    def make_pool(self, num_buckets: int, runs: dict) -> Any:
        """The pool actor of the stream's `runs` (name -> RunShape; a single run is one named "": app/run/sweep.py)."""
        import ray

        from actors.hs_pool import HSPoolActor, pool_max_concurrency

        topo = self.cfg.topology
        # Sized at creation for every actor the run may hold: the extra ones too (topology.max_extra_gpus).
        concurrency = pool_max_concurrency(topo.num_targets + max_extra_actors(topo), topo.num_drafters)
        return ray.remote(HSPoolActor).options(
            num_cpus=0, max_concurrency=concurrency,
            max_restarts=0, scheduling_strategy=self._pool_node(),  # no name: no other job can look it up
        ).remote(self.cfg.pool, num_buckets, self.run_name, broken_after=self.cfg.supervision.broken_target_raises,
                 runs=runs)

    def make_target(self, i: int, model_dir: str, layer_ids: list[int], dataset_ref: Any, faults: Any) -> Any:
        import ray

        from actors.target import TargetActor, target_concurrency
        from app.replay.spec import replay_spec

        topo, bundle = self.cfg.topology, self.shape(self.target_bundle(i))
        concurrency = target_concurrency(topo.device, self.plan.use_gpu, self.cfg.pool.jobs_in_flight_per_target)
        return ray.remote(TargetActor).options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0, max_concurrency=concurrency,
            scheduling_strategy=self.strategy(self.target_bundle(i)),
        ).remote(i, model_dir, layer_ids, self.cfg.model, topo.device if self.plan.use_gpu else "cpu",
                 bundle["CPU"], dataset_ref, faults, self.cfg.checkpoint.dir, transport=self.cfg.pool.transport,
                 replay=replay_spec(self.cfg))

    def make_drafters(self, setup: Any, pool: Any, bundles: list[int] | None = None) -> list[Any]:
        """One rank per bundle index in `bundles` (default: every drafter bundle); rank r sits in bundles[r].
        A group rebuilt after a node loss may get fewer bundles than the topology has (their GPUs are gone)."""
        import ray

        from actors.drafter import DrafterActor

        if bundles is None:
            bundles = list(self.drafter_bundles)
        actors = []
        for rank, index in enumerate(bundles):
            bundle = self.shape(index)
            actors.append(ray.remote(DrafterActor).options(
                # Two threads: `run` trains on one, the supervisor's `progress` query is answered on the other.
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0, max_concurrency=2,
                scheduling_strategy=self.strategy(index),
            ).remote(rank, setup, pool))
        return actors

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)
        for pg, _ in self.extra.values():
            remove_placement_group(pg)


def max_extra_actors(topo) -> int:
    """The most extra actors max_extra_gpus can give (for sizing the pool's concurrency at its creation)."""
    if topo.max_extra_gpus <= 0:
        return 0
    smallest = min(topo.gpus_per_target or 1.0, topo.gpus_per_drafter or 1.0)
    return int(topo.max_extra_gpus / smallest + 1e-9)


def bundle_probe() -> bool:
    """Runs in a bundle to show it is placed on a live node (see Topology.wait_bundles)."""
    return True
