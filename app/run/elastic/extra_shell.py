"""The Ray shell of extra GPUs: carries out what `app/run/elastic/extra.py` decides (topology.max_extra_gpus).

Each loop turn, `ExtraGpus.observe` reads the cluster's free resources (`ray.available_resources()`,
every PROBE_EVERY_S: the run's own placement groups are already subtracted there) and feeds the
planner the advisor's estimate. On an `Extra`:
1. a placement group of the one bundle is created (`Topology.add_extra`: its own bundle index, removed
   at the run's end with the main group); it must be placed within PLACE_TIMEOUT_S, else it is removed
   and the planner told why (a probe can see room another job takes first);
2. placed, a target goes in at once: a new target slot (ids counting on, as a re-split's), started
   without blocking the loop; the pool hands it jobs as to any target once it answers (the pool's
   concurrency was sized at its creation for every extra actor). No checkpoint: a target joining the
   pool changes no trained job;
3. placed, a drafter rank is added the growth's way: the pool is asked to stop, rank 0 checkpoints at the
   next step boundary, and `carry_out` rebuilds the group one rank larger from that checkpoint
   (`stop_at_checkpoint` / `resume_pool`): every job trained once, the loss continuous.
Timeline rows `extra` (asked for) and `extra_done`; summary.json extra_gpus; dflash_restarts_total{kind=extra}.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable

from app.run.elastic.extra import SIDES, Extra, ExtraPlanner, bundle_shape
from app.run.elastic.resplit_shell import resume_pool, stop_at_checkpoint, stopped_for_change

PROBE_EVERY_S = 2.0  # the free resources are read this often
PLACE_TIMEOUT_S = 30.0  # an extra placement group not placed by then is removed


class ExtraGpus:
    """The planner, the extra placement group being placed, and the drafter rebuild in progress."""

    def __init__(self, planner: ExtraPlanner, advisor, trigger, target_ids: Iterator[int], topology, *, topo, group,
                 pool, fleet, target_policy, drafter_policy, monitor, clock: Callable[[], float],
                 log: Callable[[str], None]) -> None:
        """`planner`: the run's ExtraPlanner (its bundles go in summary.json through the monitor); `advisor` and
        `trigger`: its SplitAdvisor and Rebalancer, told the new split; `target_ids`: the ids new target slots
        take (shared with the re-split's shell); `topology`: the config section the bundle shapes come from."""
        self.planner, self.advisor, self.trigger, self.target_ids = planner, advisor, trigger, target_ids
        self.topology = topology
        self.topo, self.group, self.pool, self.fleet = topo, group, pool, fleet
        self.target_policy, self.drafter_policy = target_policy, drafter_policy
        self.monitor, self.clock, self.log = monitor, clock, log
        self.shapes: dict[str, dict[str, float]] = {}  # side -> bundle, from the topology at the first look
        self.placing: tuple[Extra, int, Any, float] | None = None  # (extra, bundle index, ready ref, since)
        self.stopping: tuple[Extra, int] | None = None  # an extra drafter: the group stops for it
        self.free: dict[str, float] | None = None
        self._probed_at = float("-inf")

    # ---- each loop turn --------------------------------------------------------------------

    def observe(self, busy: bool) -> None:
        """`busy`: the group is already stopping (a SIGTERM, another change): no extra bundle is asked for."""
        if not self.planner.enabled:
            return
        now = self.clock()
        if self.placing is not None:
            self._placing(now)
            return
        if self.stopping is not None:
            return
        if now - self._probed_at >= PROBE_EVERY_S:
            import ray

            self.free, self._probed_at = dict(ray.available_resources()), now
        topo, group, advisor = self.topo, self.group, self.advisor
        if not self.shapes:
            self.shapes = {side: bundle_shape(self.topology, side, topo.plan.use_gpu) for side in SIDES}
        est = advisor.estimate(stable=True) if advisor.enough_samples() else None
        blocked = (busy or not group.run_refs
                   or len(group.in_use) < len(topo.drafter_bundles))  # a shrunk group grows back first
        split = (est.current_targets, est.current_drafters) if est is not None \
            else (len(topo.target_bundles), len(topo.drafter_bundles))
        for extra in self.planner.observe(now, est, split, self.free, self.shapes, blocked):
            self._begin(extra, now)

    def wants(self, results) -> bool:
        """True when the group's return is the stop an extra drafter asked for."""
        if self.stopping is not None and not stopped_for_change(self.drafter_policy, results):
            self.planner.failed("the run stopped first")
            self.stopping = None
        return self.stopping is not None

    # ---- an extra bundle -------------------------------------------------------------------

    def _begin(self, extra: Extra, now: float) -> None:
        from ray.util.placement_group import placement_group

        pg = placement_group([extra.shape], strategy="PACK", name=f"dflash-{self.topo.run_name}-extra{extra.number}")
        index = self.topo.add_extra(pg, extra.shape)
        self.placing = (extra, index, pg.ready(), now)
        self.monitor.resplit_event("extra", **extra.to_dict(), bundle=index)
        self.log(f"extra GPUs: asking for one more {extra.side[:-1]} bundle {extra.shape} "
                 f"({extra.old[0]}/{extra.old[1]} -> {extra.new[0]}/{extra.new[1]} targets/drafters): {extra.why}")

    def _placing(self, now: float) -> None:
        import ray

        extra, index, ready, since = self.placing
        if not ray.wait([ready], timeout=0)[0]:
            if now - since >= PLACE_TIMEOUT_S:
                self.placing = None
                self.topo.drop_extra(index)
                why = f"its placement group was not placed within {PLACE_TIMEOUT_S:g} s (removed)"
                self.planner.failed(why)
                self.log(f"extra GPUs: no extra {extra.side[:-1]}: {why}")
            return
        self.placing = None
        if extra.side == "targets":
            self._add_target(extra, index)
        else:
            self.stopping = (extra, index)
            self.log(f"extra GPUs: bundle {index} placed; adding a drafter rank, checkpointing at the next "
                     "step boundary")
            self.pool.request_stop()

    def _add_target(self, extra: Extra, index: int) -> None:
        tid = next(self.target_ids)  # target ids count on, shared with the re-split's new slots
        self.topo.target_bundles[tid] = index
        self.target_policy.add_target(tid)  # STARTING; the pool takes it once its first ping answers
        self.fleet.add(tid)
        self.pool.report_restart("extra")  # dflash_restarts_total{kind="extra"}
        self.planner.done()
        split = self._new_split(targets=len(self.topo.target_bundles))
        self.monitor.resplit_event("extra_done", number=extra.number, side=extra.side, old=list(extra.old),
                                   new=list(split), bundle=index, target_id=tid, why=extra.why)
        self.log(f"extra GPUs: target {tid} starting in bundle {index} ({extra.old[0]}/{extra.old[1]} -> "
                 f"{split[0]}/{split[1]} targets/drafters)")

    def carry_out(self):
        """The group stopped for an extra drafter: resume it one rank larger from the checkpoint.
        Returns the group's start event (DrafterGroupStarted, or DrafterGroupFailed) for the policy."""
        topo, group = self.topo, self.group
        (extra, index), self.stopping = self.stopping, None
        ckpt, ledger = stop_at_checkpoint(group)
        topo.drafter_bundles.append(index)
        requeued = resume_pool(self.pool, ledger, "extra")  # dflash_restarts_total{kind="extra"}
        started = group.start(str(ckpt) if ckpt else None, rebuilding=True, bundles=list(topo.drafter_bundles))
        size = len(group.ranks) if group.run_refs else 0
        if size:
            self.planner.done()
        else:
            self.planner.failed("the group rebuild failed")
        split = self._new_split(targets=len(topo.target_bundles))
        self.monitor.resplit_event("extra_done", number=extra.number, side=extra.side, old=list(extra.old),
                                   new=list(split), bundle=index, checkpoint=ckpt.name if ckpt else None,
                                   requeued=requeued, why=extra.why)
        self.log(f"extra GPUs: drafter group {extra.old[1]} -> {size} ranks from "
                 f"{ckpt.name if ckpt else 'scratch'}; {requeued} leased jobs re-issued")
        return started

    def _new_split(self, targets: int) -> tuple[int, int]:
        """The split the run now has: the advisor measures it afresh (its best split is over the new GPU
        count), and the re-split trigger compares its advice against it."""
        split = (targets, len(self.topo.drafter_bundles))
        self.advisor.resplit(*split)
        self.trigger.split = split  # not a re-split: max_rebalances is not spent on it
        return split
