"""The Ray shell of an automatic re-split: carries out what `app/run/elastic/resplit.py` decides.

`Resplitter.observe` feeds the trigger each loop turn (the advisor's estimate, the training tokens)
and, on a `Resplit`, checks that the bundles can swap roles and asks the pool to stop: rank 0 then
checkpoints at the next step boundary and the group returns (the stop path every SIGTERM takes, so
no trained work is lost and the checkpoint's ledger holds the last step's jobs). `carry_out` is called
with that stopped group:
1. the ranks are gone and the stop's checkpoint found (`DrafterGroup.stop_for_rebuild`);
2. targets giving their bundle to the drafters leave the pool (`remove_target`: their in-flight jobs go
   back to the queue, a late answer is dropped) and are killed; drafter bundles given to the targets get
   new target slots, started without blocking the loop;
3. the pool rolls back to the checkpoint's ledger (held acks acked, prefetched leases re-queued: none
   trained), its stop flag is cleared, and a group of the new size resumes from the checkpoint (elastic
   resume: the ledger is per job, the LR schedule runs on jobs), telling the pool its rank count.
Every job is trained once: the checkpoint's weights hold exactly its ledger's jobs, and only jobs
outside it are issued again. A growth (`app/run/elastic/grow_shell.py`: bundles lost with a node placed again) is
the same stop and rebuild without moves: `stopped_for_change`, `stop_at_checkpoint`, `resume_pool`.

Each shell is handed the parts it uses, once the stream has started them: the run's view of the `Topology`
(`RunTopology`), its `DrafterGroup` and run-scoped `PoolClient`, the stream's `Targets` (the fleet) and
`TargetPolicy` (target slots added, retired, given up), the run's `DrafterPolicy` (a SIGTERM's stop pending),
the `RunMonitor` its rows and tokens go through, its planner (app/run/elastic/planners.py), the clock and the
log. The run's supervisor (app/run/run_supervisor.py) says each loop turn whether the group is already
changing (`observe(busy)`): one change at a time.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Callable

from app.run.elastic.resplit import Resplit, ResplitMeasured


def same_shape(bundles: list[dict[str, float]], a: int, b: int) -> str:
    """'' when bundles `a` and `b` may swap roles (the same GPUs; the CPUs go with the bundle), else why not."""
    ga, gb = bundles[a].get("GPU", 0), bundles[b].get("GPU", 0)
    if ga != gb:
        return (f"target and drafter bundles differ in shape (GPU {ga:g} vs {gb:g}); only bundles of the same "
                "shape swap roles: set topology.gpus_per_target = topology.gpus_per_drafter, or change the split "
                "by hand (resubmit with other topology.num_*)")
    return ""


def stopped_for_change(drafter_policy, results) -> bool:
    """True when the group's return is the stop a change of the group asked for (not the run's end,
    not a SIGTERM, not a non-finite loss)."""
    return drafter_policy.stop_deadline is None and all(r.stopped and not r.nonfinite for r in results)


def stop_at_checkpoint(group):
    """The group stopped at a step boundary: its ranks gone, (checkpoint or None, that checkpoint's ledger)."""
    ckpt, ledger = group.stop_for_rebuild()
    group.drain_records()  # the stopped group's last reports belong before the new group's start
    return ckpt, ledger


def resume_pool(pool, ledger: list[int], kind: str) -> int:
    """The pool back to the checkpoint's ledger, its stop flag cleared, the change counted in
    dflash_restarts_total{kind}; returns how many leased jobs go out again."""
    requeued = pool.rollback(ledger)
    pool.clear_stop()
    pool.report_restart(kind)
    return requeued


class Resplitter:
    """The trigger, the stop in progress, and the moves of one re-split."""

    def __init__(self, trigger, advisor, target_ids: Iterator[int], *, topo, group, pool, fleet, target_policy,
                 drafter_policy, monitor, clock: Callable[[], float], log: Callable[[str], None]) -> None:
        """`trigger`: the run's Rebalancer; `advisor`: its SplitAdvisor; `target_ids`: the ids new target slots
        take, counting on from the configured ones (shared with the extra GPUs' shell)."""
        self.trigger, self.advisor, self.target_ids = trigger, advisor, target_ids
        self.topo, self.group, self.pool, self.fleet = topo, group, pool, fleet
        self.target_policy, self.drafter_policy = target_policy, drafter_policy
        self.monitor, self.clock, self.log = monitor, clock, log
        self.stopping: Resplit | None = None  # asked the group to stop for this re-split

    # ---- each loop turn --------------------------------------------------------------------

    def observe(self, busy: bool) -> None:
        """`busy`: the group is already stopping (a SIGTERM, another change): no new re-split."""
        now = self.clock()
        for measured in self.trigger.tokens(self.monitor.train_tokens, now):
            self._measured(measured)
        if busy:
            return
        est = self.advisor.estimate(stable=True) if self.advisor.enough_samples() else None
        for rs in self.trigger.observe(est, now):
            self._begin(rs)

    def wants(self, results) -> bool:
        """True when the group's return is this re-split's stop (not the run's end, not a SIGTERM)."""
        return self.stopping is not None and stopped_for_change(self.drafter_policy, results)

    # ---- a re-split ------------------------------------------------------------------------

    def _begin(self, rs: Resplit) -> None:
        why = self._why_not(rs)
        text = (f"re-split {rs.old[0]}/{rs.old[1]} -> {rs.new[0]}/{rs.new[1]} targets/drafters (target "
                f"{rs.target_tok_s:.0f} tok/s, drafter rank {rs.drafter_tok_s:.0f} tok/s, estimated "
                f"{100 * rs.gain_estimated:+.0f}% tokens/s)")
        if why:
            self.trigger.refused(why)
            self.monitor.resplit_event("resplit_refused", **rs.to_dict(), reason=why)
            self.log(f"{text} not done: {why}")
            return
        self.stopping = rs
        self.monitor.resplit_event("resplit", **rs.to_dict())
        self.log(f"{text}: checkpointing at the next step boundary (topology.rebalance=auto, "
                 f"{rs.number}/{self.trigger.max_rebalances})")
        self.pool.request_stop()

    def _why_not(self, rs: Resplit) -> str:
        topo = self.topo
        tids = sorted(topo.target_bundles)
        if not tids or not topo.drafter_bundles:
            return "no target or no drafter bundle to move"
        group = self.group.in_use
        if len(group) < len(topo.drafter_bundles):  # a lost node's bundles: the growth comes first
            return (f"the drafter group runs on {len(group)} of its {len(topo.drafter_bundles)} bundles (a node "
                    "was lost); it grows back when they are placed again")
        shapes = {b: topo.shape(b) for b in (topo.target_bundles[tids[0]], topo.drafter_bundles[0])}
        return same_shape(shapes, topo.target_bundles[tids[0]], topo.drafter_bundles[0])

    def carry_out(self):
        """The group stopped for the re-split: move the bundles and resume a group of the new size.
        Returns the group's start event (DrafterGroupStarted, or DrafterGroupFailed) for the policy."""
        rs, topo = self.stopping, self.topo
        ckpt, ledger = stop_at_checkpoint(self.group)
        old_t, old_d = len(topo.target_bundles), len(topo.drafter_bundles)
        new_t, new_d = rs.new
        moved: list[str] = []
        for _ in range(max(0, old_t - new_t)):  # targets -> drafters: the newest target slots go
            tid = max(topo.target_bundles)
            requeued = self.pool.remove_target(tid)
            self.fleet.retire(tid)
            self.target_policy.retire_target(tid)
            topo.drafter_bundles.append(topo.target_bundles.pop(tid))
            moved.append(f"target {tid} -> drafter ({len(requeued)} in-flight jobs re-queued)")
        new_targets = []
        for _ in range(max(0, old_d - new_d)):  # drafters -> targets: the last drafter bundles go
            tid = next(self.target_ids)
            topo.target_bundles[tid] = topo.drafter_bundles.pop()
            self.target_policy.add_target(tid)
            new_targets.append(tid)
            moved.append(f"drafter bundle {topo.target_bundles[tid]} -> target {tid}")
        requeued = resume_pool(self.pool, ledger, "resplit")  # dflash_restarts_total{kind="resplit"}
        for tid in new_targets:  # after the old ranks are gone: their bundles are free
            self.fleet.add(tid)
        split = (len(topo.target_bundles), len(topo.drafter_bundles))
        self.advisor.resplit(*split)
        self.monitor.resplit_event("resplit_done", number=rs.number, old=[old_t, old_d], new=list(split),
                                   checkpoint=ckpt.name if ckpt else None, requeued=requeued, moved=moved)
        self.log(f"re-split {old_t}/{old_d} -> {split[0]}/{split[1]} from {ckpt.name if ckpt else 'scratch'}: "
                 f"{'; '.join(moved)}; {requeued} leased jobs re-issued")
        started = self.group.start(str(ckpt) if ckpt else None, rebuilding=True, bundles=list(topo.drafter_bundles))
        # The measured window starts once the new group trains: the rebuild's own time is its cost,
        # paid once, not the new split's rate (the run's tokens/s in summary.json include it).
        self.trigger.done(*split, now=self.clock(), tokens=self.monitor.train_tokens)
        self.stopping = None
        return started

    def _measured(self, m: ResplitMeasured) -> None:
        self.monitor.resplit_event("resplit_measured", **m.to_dict())
        self.log(f"re-split {m.number} ({m.old[0]}/{m.old[1]} -> {m.new[0]}/{m.new[1]}): training "
                 f"{m.before_tok_s:.0f} -> {m.after_tok_s:.0f} tok/s ({100 * m.gain_measured:+.0f}% measured, "
                 f"{100 * m.gain_estimated:+.0f}% estimated)")
