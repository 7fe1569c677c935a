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

from typing import Any, Callable

from app.run.elastic.extra import SIDES, Extra, ExtraPlanner, bundle_shape
from app.run.elastic.resplit_shell import resume_pool, stop_at_checkpoint, stopped_for_change

PROBE_EVERY_S = 2.0  # the free resources are read this often
PLACE_TIMEOUT_S = 30.0  # an extra placement group not placed by then is removed


class ExtraGpus:
    """The planner, the extra placement group being placed, and the drafter rebuild in progress."""

    def __init__(self, sup, log: Callable[[str], None]) -> None:
        self.sup, self.log = sup, log
        self.planner = ExtraPlanner.for_topology(sup.cfg.topology)
        sup.monitor.extra = self.planner  # summary.json: extra_gpus, extra_history
        self.shapes: dict[str, dict[str, float]] = {}  # side -> bundle, from the topology at the first look
        self.placing: tuple[Extra, int, Any, float] | None = None  # (extra, bundle index, ready ref, since)
        self.stopping: tuple[Extra, int] | None = None  # an extra drafter: the group stops for it
        self.free: dict[str, float] | None = None
        self._probed_at = float("-inf")

    # ---- each loop turn --------------------------------------------------------------------

    def observe(self) -> None:
        if not self.planner.enabled:
            return
        sup = self.sup
        now = sup.clock()
        if self.placing is not None:
            self._placing(now)
            return
        if self.stopping is not None:
            return
        if now - self._probed_at >= PROBE_EVERY_S:
            import ray

            self.free, self._probed_at = dict(ray.available_resources()), now
        topo, group, advisor = sup.topo, sup.group, sup.monitor.advisor
        if not self.shapes:
            self.shapes = {side: bundle_shape(sup.cfg.topology, side, topo.plan.use_gpu) for side in SIDES}
        est = advisor.estimate(stable=True) if advisor is not None and advisor.enough_samples() else None
        blocked = (sup.changing_group() or not group.run_refs
                   or len(group.in_use) < len(topo.drafter_bundles))  # a shrunk group grows back first
        split = (est.current_targets, est.current_drafters) if est is not None \
            else (len(topo.target_bundles), len(topo.drafter_bundles))
        for extra in self.planner.observe(now, est, split, self.free, self.shapes, blocked):
            self._begin(extra, now)

    def wants(self, results) -> bool:
        """True when the group's return is the stop an extra drafter asked for."""
        if self.stopping is not None and not stopped_for_change(self.sup, results):
            self.planner.failed("the run stopped first")
            self.stopping = None
        return self.stopping is not None

    # ---- an extra bundle -------------------------------------------------------------------

    def _begin(self, extra: Extra, now: float) -> None:
        from ray.util.placement_group import placement_group

        sup = self.sup
        pg = placement_group([extra.shape], strategy="PACK", name=f"dflash-{sup.topo.run_name}-extra{extra.number}")
        index = sup.topo.add_extra(pg, extra.shape)
        self.placing = (extra, index, pg.ready(), now)
        sup.monitor.resplit_event("extra", **extra.to_dict(), bundle=index)
        self.log(f"extra GPUs: asking for one more {extra.side[:-1]} bundle {extra.shape} "
                 f"({extra.old[0]}/{extra.old[1]} -> {extra.new[0]}/{extra.new[1]} targets/drafters): {extra.why}")

    def _placing(self, now: float) -> None:
        import ray

        extra, index, ready, since = self.placing
        if not ray.wait([ready], timeout=0)[0]:
            if now - since >= PLACE_TIMEOUT_S:
                self.placing = None
                self.sup.topo.drop_extra(index)
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
            self.sup.pool.request_stop()

    def _add_target(self, extra: Extra, index: int) -> None:
        sup = self.sup
        tid = sup.resplit.next_target_id  # target ids count on, shared with the re-split's new slots
        sup.resplit.next_target_id += 1
        sup.topo.target_bundles[tid] = index
        sup.policy.add_target(tid)  # STARTING; the pool takes it once its first ping answers
        sup.fleet.add(tid)
        sup.pool.report_restart("extra")  # dflash_restarts_total{kind="extra"}
        self.planner.done()
        split = self._new_split(targets=len(sup.topo.target_bundles))
        sup.monitor.resplit_event("extra_done", number=extra.number, side=extra.side, old=list(extra.old),
                                  new=list(split), bundle=index, target_id=tid, why=extra.why)
        self.log(f"extra GPUs: target {tid} starting in bundle {index} ({extra.old[0]}/{extra.old[1]} -> "
                 f"{split[0]}/{split[1]} targets/drafters)")

    def carry_out(self):
        """The group stopped for an extra drafter: resume it one rank larger from the checkpoint.
        Returns the group's start event (DrafterGroupStarted, or DrafterGroupFailed) for the policy."""
        sup = self.sup
        (extra, index), self.stopping = self.stopping, None
        ckpt, ledger = stop_at_checkpoint(sup)
        sup.topo.drafter_bundles.append(index)
        requeued = resume_pool(sup, ledger, "extra")  # dflash_restarts_total{kind="extra"}
        started = sup.group.start(str(ckpt) if ckpt else None, rebuilding=True, bundles=list(sup.topo.drafter_bundles))
        size = len(sup.group.ranks) if sup.group.run_refs else 0
        if size:
            self.planner.done()
        else:
            self.planner.failed("the group rebuild failed")
        split = self._new_split(targets=len(sup.topo.target_bundles))
        sup.monitor.resplit_event("extra_done", number=extra.number, side=extra.side, old=list(extra.old),
                                  new=list(split), bundle=index, checkpoint=ckpt.name if ckpt else None,
                                  requeued=requeued, why=extra.why)
        self.log(f"extra GPUs: drafter group {extra.old[1]} -> {size} ranks from "
                 f"{ckpt.name if ckpt else 'scratch'}; {requeued} leased jobs re-issued")
        return started

    def _new_split(self, targets: int) -> tuple[int, int]:
        """The split the run now has: the advisor measures it afresh (its best split is over the new GPU
        count), and the re-split trigger compares its advice against it."""
        sup = self.sup
        split = (targets, len(sup.topo.drafter_bundles))
        if sup.monitor.advisor is not None:
            sup.monitor.advisor.resplit(*split)
        sup.resplit.trigger.split = split  # not a re-split: max_rebalances is not spent on it
        return split
