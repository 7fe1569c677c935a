"""Will the run's placement group fit the cluster? A pure check over `ray.nodes()`-shaped data.

A placement group reserves every bundle before any actor starts; one that cannot fit waits forever
(or until the driver's 120 s timeout, `wait_placement`, which then says what is free) with no word of
what is missing. This check places the bundles
the way the chosen strategy would, on the live nodes' totals, and names what is short on which node:

    topology does not fit the cluster (PACK): drafter 2 bundle {CPU: 4, GPU: 1} fits on no node:
    10.0.0.1 has 0 of 8 GPU left, 10.0.0.2 has 2.0 of 16 CPU left; add a node with 1 GPU and 4 CPU,
    or lower topology.num_drafters / topology.gpus_per_drafter

PACK puts bundles on as few nodes as possible (fullest node first); SPREAD on as many as possible
(emptiest node first). Both may use several nodes, so the check is a bin packing of bundles into nodes,
largest bundle first; it is exact for the equal-sized bundles a topology makes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from app.config.checks import actor_bundles, bundle_totals

STRATEGIES = ("PACK", "SPREAD")
RESOURCES = ("GPU", "CPU")  # what a bundle asks for; memory and custom resources are not reserved


class PlacementError(ValueError):
    """The topology cannot fit the cluster; the message is one line naming the shortfall and the fix."""


@dataclass
class NodeRoom:
    """What one live node has in total and what the bundles placed so far leave."""

    name: str
    total: dict[str, float]
    left: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.left:
            self.left = dict(self.total)

    def fits(self, bundle: dict[str, float]) -> bool:
        return all(self.left.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items() if v > 0)

    def take(self, bundle: dict[str, float]) -> None:
        for k, v in bundle.items():
            self.left[k] = self.left.get(k, 0.0) - v

    def used_share(self) -> float:
        return sum(1 - self.left.get(k, 0) / t for k, t in self.total.items() if k in RESOURCES and t > 0)


@dataclass(frozen=True)
class Fit:
    """Where each bundle would go (node name per bundle index)."""

    nodes: list[str]

    def spread(self) -> int:
        return len(set(self.nodes))


def nodes_from_ray(nodes: Iterable[dict[str, Any]]) -> list[NodeRoom]:
    """Live nodes of `ray.nodes()` with their CPU/GPU totals, named by address (node id when absent)."""
    rooms = []
    for n in nodes:
        if not n.get("Alive", True):
            continue
        res = n.get("Resources", {})
        name = n.get("NodeManagerAddress") or str(n.get("NodeID", "?"))[:8]
        if any(r.name == name for r in rooms):  # several raylets on one host (test clusters)
            name = f"{name}/{str(n.get('NodeID', len(rooms)))[:8]}"
        rooms.append(NodeRoom(name, {k: float(res.get(k, 0.0)) for k in RESOURCES}))
    return rooms


def bundle_labels(num_targets: int, num_drafters: int) -> list[str]:
    """What each bundle holds, in the topology's order (targets first)."""
    return [f"target {i}" for i in range(num_targets)] + [f"drafter {r}" for r in range(num_drafters)]


def place(bundles: list[dict[str, float]], labels: list[str], nodes: list[NodeRoom], strategy: str) -> Fit:
    """Place every bundle like `strategy` would; raises PlacementError naming the first that fits nowhere."""
    if strategy not in STRATEGIES:
        raise PlacementError(f"topology.strategy={strategy!r} is not one of {', '.join(STRATEGIES)}; pick one of them")
    if not nodes:
        raise PlacementError("the cluster has no live node; start one (ray start) before submitting")
    where: list[str | None] = [None] * len(bundles)
    # Largest bundle first: a big drafter bundle must not find its node already filled by small ones.
    order = sorted(range(len(bundles)), key=lambda i: tuple(-bundles[i].get(k, 0.0) for k in RESOURCES))
    for i in order:
        candidates = [n for n in nodes if n.fits(bundles[i])]
        if not candidates:
            raise PlacementError(_shortfall(bundles[i], labels[i], nodes, strategy, bundles))
        # PACK: the fullest node that still fits; SPREAD: the emptiest.
        pick = (max if strategy == "PACK" else min)(candidates, key=lambda n: n.used_share())
        pick.take(bundles[i])
        where[i] = pick.name
    return Fit([w or "" for w in where])


def check_placement(bundles: list[dict[str, float]], num_targets: int, num_drafters: int,
                    ray_nodes: Iterable[dict[str, Any]], strategy: str) -> Fit:
    """The check the driver runs before creating the placement group (`ray_nodes` = `ray.nodes()`)."""
    return place(bundles, bundle_labels(num_targets, num_drafters), nodes_from_ray(ray_nodes), strategy)


def _fmt(x: float) -> str:
    return f"{round(x, 4):g}"


def _shortfall(bundle: dict[str, float], label: str, nodes: list[NodeRoom], strategy: str,
               bundles: list[dict[str, float]]) -> str:
    kind = label.split()[0]  # target | drafter
    want = ", ".join(f"{k}: {_fmt(v)}" for k, v in sorted(bundle.items(), reverse=True) if v > 0)
    per_node = []
    for n in nodes:
        short = [f"{_fmt(max(n.left.get(k, 0.0), 0.0))} of {_fmt(n.total.get(k, 0.0))} {k} left"
                 for k, v in sorted(bundle.items(), reverse=True) if v > 0 and n.left.get(k, 0.0) + 1e-9 < v]
        per_node.append(f"{n.name} has {' and '.join(short)}")
    need = bundle_totals(bundles)["GPU"]
    total_gpu = sum(n.total.get("GPU", 0.0) for n in nodes)
    totals = f" (the topology needs {_fmt(need)} GPU, the cluster has {_fmt(total_gpu)})" if need > total_gpu else ""
    fix = (f"add a node with {want.replace(': ', ' ').replace(', ', ' and ')}, or lower topology.num_{kind}s / "
           f"topology.gpus_per_{kind} / topology.cpus_per_{kind}")
    return (f"topology does not fit the cluster ({strategy}){totals}: {label} bundle {{{want}}} fits on no node: "
            f"{'; '.join(per_node)}; {fix}")


def check_cluster_fits(cfg, use_gpu: bool, ray_nodes: Iterable[dict[str, Any]]) -> Fit:
    """The driver's check before any actor starts: a misfit is a ConfigError (one line, exit 2)."""
    from app.config.load import ConfigError

    topo = cfg.topology  # the bundles app/run/topology.plan_bundles gives the placement group
    try:
        return check_placement(actor_bundles(topo, use_gpu), topo.num_targets, topo.num_drafters, ray_nodes,
                               topo.strategy)
    except PlacementError as exc:
        raise ConfigError(str(exc)) from None


PLACEMENT_TIMEOUT_S = 120.0  # a placement group the check let through should be ready long before this


def wait_placement(pg: Any, bundles: list[dict[str, float]], timeout_s: float = PLACEMENT_TIMEOUT_S) -> None:
    """Wait for the placement group; past `timeout_s` raise ConfigError (one line, exit 2) with what the
    cluster has free now against what the bundles ask: they fit the nodes' totals (`check_cluster_fits`),
    so other jobs hold the rest, or nodes are still starting."""
    import ray

    from app.config.errors import ConfigError

    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if ready:
        return
    free, total = ray.available_resources(), ray.cluster_resources()
    need = {r: sum(b.get(r, 0.0) for b in bundles) for r in RESOURCES}
    have = ", ".join(f"{_fmt(free.get(r, 0.0))} of {_fmt(total.get(r, 0.0))} {r}" for r in RESOURCES if need[r])
    ask = ", ".join(f"{_fmt(need[r])} {r}" for r in RESOURCES if need[r])
    raise ConfigError(f"the placement group of {len(bundles)} bundles ({ask}) was not ready after {timeout_s:g} s: "
                      f"the cluster has {have} free; other jobs or actors hold the rest, or nodes are still "
                      "starting: free them, wait for the nodes, or lower topology.num_targets / num_drafters")
