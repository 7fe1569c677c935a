"""The Ray shell of growth: carries out what `app/run/elastic/grow.py` decides.

Each loop turn, `Grower.observe` probes the bundles a node loss left without a node (the drafter
bundles the running group does not sit in, the bundles of given-up target slots): one resource-free
probe task per bundle stays in flight and runs once Ray has re-placed that bundle on a live node.
- A `Grow` asks the pool to stop: rank 0 checkpoints at the next step boundary and the group returns;
  `carry_out` then rebuilds it on every placed drafter bundle from that checkpoint, by the re-split's
  path (`app/run/elastic/resplit_shell.py` stop_at_checkpoint / resume_pool): every job trained once.
- A `ReturnTarget` starts the slot again (a fresh restart budget); the pool takes it when it answers.
A bundle placed once and lost again keeps its last answer until its next probe returns; the growth's
group start then fails and the supervision's rebuild (with its bundle waits) takes over.
"""
from __future__ import annotations

from typing import Any, Callable

from app.run.elastic.grow import Grow, GrowthPlanner, ReturnTarget
from app.run.elastic.resplit_shell import resume_pool, stop_at_checkpoint, stopped_for_change
from app.run.supervise.policy import TargetState

PROBE_EVERY_S = 2.0  # a placed bundle is probed again this often (its node may go away again)
UNPLACED_AFTER_S = 5.0  # a probe unanswered this long: its bundle has no node


class Grower:
    """The probes in flight, the planner, and the growth in progress."""

    def __init__(self, planner: GrowthPlanner, *, topo, group, pool, fleet, target_policy, drafter_policy, monitor,
                 clock: Callable[[], float], log: Callable[[str], None]) -> None:
        """`planner`: the run's GrowthPlanner (its growths go in summary.json through the monitor)."""
        self.planner = planner
        self.topo, self.group, self.pool, self.fleet = topo, group, pool, fleet
        self.target_policy, self.drafter_policy = target_policy, drafter_policy
        self.monitor, self.clock, self.log = monitor, clock, log
        self.stopping: Grow | None = None
        self.probes: dict[int, tuple[Any, float]] = {}  # bundle -> (probe ref in flight, sent at)
        self.placed: set[int] = set()  # bundles whose latest answered probe ran on a live node

    # ---- each loop turn --------------------------------------------------------------------

    def observe(self, busy: bool) -> None:
        """`busy`: the group is already stopping (a SIGTERM, another change): no growth begins."""
        topo, group, targets = self.topo, self.group, self.target_policy.targets
        lost = [b for b in topo.drafter_bundles if b not in group.in_use]
        given_up = {tid: b for tid, b in topo.target_bundles.items()
                    if tid in targets and targets[tid].state is TargetState.GIVEN_UP}
        if not lost and not given_up and self.stopping is None:
            self.probes, self.placed = {}, set()
            return
        placed, unplaced = self._probe([*lost, *given_up.values()])
        blocked = busy or not group.run_refs
        for grow in self.planner.observe(self.clock(), group.in_use, topo.drafter_bundles, placed, blocked):
            self._begin(grow)
        for back in self.planner.targets(given_up, placed, unplaced):
            self._return_target(back)

    def wants(self, results) -> bool:
        """True when the group's return is this growth's stop."""
        if self.stopping is not None and not stopped_for_change(self.drafter_policy, results):
            self.planner.failed("the run stopped first")
            self.stopping = None
        return self.stopping is not None

    # ---- a growth --------------------------------------------------------------------------

    def _begin(self, grow: Grow) -> None:
        self.stopping = grow
        self.monitor.resplit_event("grow", **grow.to_dict())
        self.log(f"growing the drafter group {grow.old} -> {grow.new} ranks (configured {grow.configured}): "
                 f"{grow.why}; checkpointing at the next step boundary")
        self.pool.request_stop()

    def carry_out(self):
        """The group stopped for the growth: resume a group on every placed drafter bundle.
        Returns the group's start event (DrafterGroupStarted, or DrafterGroupFailed) for the policy."""
        grow, group = self.stopping, self.group
        ckpt, ledger = stop_at_checkpoint(group)
        requeued = resume_pool(self.pool, ledger, "grow")  # dflash_restarts_total{kind="grow"}
        bundles = [b for b in self.topo.drafter_bundles if b in grow.bundles]
        started = group.start(str(ckpt) if ckpt else None, rebuilding=True, bundles=bundles)
        size = len(group.ranks) if group.run_refs else 0
        self.monitor.resplit_event("grow_done", number=grow.number, old=grow.old, new=size,
                                   configured=grow.configured, bundles=bundles, why=grow.why,
                                   checkpoint=ckpt.name if ckpt else None, requeued=requeued)
        if size:
            # The split advisor keeps its rates: a rank's compute rate barely depends on the group's size
            # (its documented assumption), and the split it advises on is the topology's, unchanged.
            self.planner.done(size)
        else:
            self.planner.failed("the group rebuild failed")
        self.log(f"drafter group grew {grow.old} -> {size} of {grow.configured} ranks from "
                 f"{ckpt.name if ckpt else 'scratch'}; {requeued} leased jobs re-issued")
        self.stopping = None
        return started

    def _return_target(self, back: ReturnTarget) -> None:
        self.target_policy.add_target(back.target_id)  # STARTING, with a fresh restart budget
        self.fleet.add(back.target_id)
        self.monitor.resplit_event("target_back", target_id=back.target_id, bundle=back.bundle, why=back.why)
        self.log(f"target {back.target_id} starting again: {back.why}")

    # ---- probes ----------------------------------------------------------------------------

    def _probe(self, bundles: list[int]) -> tuple[set[int], set[int]]:
        """(placed, unplaced) of `bundles`: found on a live node by their latest answered probe; with a
        probe unanswered for UNPLACED_AFTER_S. One probe in flight per bundle."""
        import ray
        from ray.exceptions import RayError
        from app.run.topology import bundle_probe

        now = self.clock()
        for b in list(self.probes):
            if b not in bundles:
                del self.probes[b]
        self.placed &= set(bundles)
        for b in bundles:
            ref, sent = self.probes.get(b, (None, 0.0))
            if ref is not None and ray.wait([ref], timeout=0)[0]:
                try:
                    ray.get(ref)
                    self.placed.add(b)
                except RayError:  # its node died under it: not placed
                    self.placed.discard(b)
                self.probes[b] = (None, now)
                ref = None
            if ref is None and now - sent >= PROBE_EVERY_S:
                probe = ray.remote(num_cpus=0, max_retries=-1)(bundle_probe)
                strategy = self.topo.strategy(b)  # an extra bundle sits in its own placement group
                self.probes[b] = (probe.options(scheduling_strategy=strategy).remote(), now)
        unplaced = {b for b, (ref, sent) in self.probes.items() if ref is not None and now - sent >= UNPLACED_AFTER_S}
        return set(self.placed) - unplaced, unplaced
