"""The supervision shell: start the actors, feed what it sees to the policy, carry out its actions.

The decisions (restart or give up a target, rebuild the drafter group, watchdog verdicts, stop,
fail) live in `app/run/supervise/policy.py`, a pure class. `Supervisor` is the loop between it and the
actors, each behind a helper that returns the events it saw:
- the pool behind `PoolClient` (app/run/supervise/pool_client.py): retried idempotent calls, a dead pool is
  `RunFailed` with one line; what each of its snapshots says (new target failures and quarantined jobs,
  the policy's `Tick`) is `PoolWatch` (app/run/supervise/pool_watch.py);
- the targets behind `Targets` (app/run/supervise/targets.py): start, restart, liveness. A target crash: the
  pool has already put its jobs back; the policy says restart (a new actor in the same bundle,
  started without blocking the loop) or give up; a replacement whose `__init__` fails counts
  against the same budget;
- the drafters behind `DrafterGroup` (app/run/supervise/drafters.py): a crash or stall tears the whole
  group down, the pool rolls back to the latest checkpoint's ledger (jobs trained after it are
  re-issued), and a new group resumes from it.
A pool that died (`PoolDied`) is recreated within `supervision.max_restarts_pool`: a new pool
restored from the checkpoint the drafter group rebuilds from, the live targets handed to it (not
restarted), the group rebuilt. Stop (SIGTERM): the pool tells rank 0, the group checkpoints at the next step boundary and returns;
the driver exits 0 and the next submission resumes. At the end, `evaluate` measures tau with the
code of the evaluations during the run (app/run/evaluate/final_tau.py).
A single run also changes its group while it trains (app/run/elastic/: re-split, growth, extra GPUs): its
`Planners` decide, and the shells built in `start` carry out, each handed the parts it uses.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from app.model.drafter_tau import stop_token
from app.run.supervise.drafters import BundleWaits, DrafterGroup
from app.run.evaluate.schedule import eval_spec
from app.run.evaluate.final_tau import FinalTau, TauResult
from app.run.elastic.extra_shell import ExtraGpus
from app.run.elastic.grow_shell import Grower
from app.run.elastic.planners import Planners
from app.run.outputs.monitor import RunMonitor
from app.run.plan import RunPlan
from app.run.supervise.pool_client import PoolClient, PoolDied
from app.run.supervise.pool_watch import PoolWatch
from app.run.elastic.resplit_shell import Resplitter
from app.run.supervise.events import (Fail, GiveUpTarget, KillStalledTarget, PoolFailed, RebuildDrafters, RecreatePool,
                                      RequestStop, RestartTarget, RunFailed, StopSignal, TargetFailed, TargetStarted)
from app.run.supervise.policy import SupervisionPolicy, TargetState
from app.run.supervise.targets import Targets
from app.run.topology import Topology

LOOP_WAIT_S = 0.5  # each loop turn waits this long for the drafters to finish


@dataclass
class Outcome:
    """How the supervised run ended."""

    stopped: bool = False
    steps: int = 0
    drafter_results: list[Any] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=lambda: {"target": 0, "drafter_group": 0})


class Supervisor:
    """Owns the actors of one run through its helpers; observes them and carries out the policy's actions."""

    def __init__(self, plan: RunPlan, topo: Topology, monitor: RunMonitor, stop: threading.Event,
                 log=print, clock=time.monotonic, planners: Planners | None = None) -> None:
        """`planners`: the deciders of the elastic changes, the same the monitor was built with; None for the
        runs of a sweep and its stream, which change no group while they train."""
        self.plan, self.topo, self.monitor, self.stop_event, self.log = plan, topo, monitor, stop, log
        self.planners, self.cfg, self.clock = planners, plan.cfg, clock
        self.policy = SupervisionPolicy(self.cfg.supervision, self.cfg.topology.num_targets, now=clock())
        self.outcome = Outcome()
        self.watch = PoolWatch(self.cfg.pool.min_ready)  # what each pool snapshot says, reported once
        self.last_status = 0.0
        self.on_status: Callable[[dict], None] | None = None  # the run's wandb logger (app/run/finish.py)
        # The runs this supervisor drives, by name: a single run is a sweep of one (app/run/sweep.py).
        self.runs: dict[str, Supervisor] = {"": self}
        # Every tau of the run decodes with this one spec, the EOS of the target included.
        self.eval_spec = eval_spec(plan, stop_token(plan.info.eos_token_ids))
        self.bundles = BundleWaits(topo, log)
        self.pool: PoolClient | None = None
        self.fleet: Targets | None = None
        self.group: DrafterGroup | None = None
        self.changes: tuple = ()  # the elastic shells, in the order they are asked (built in `start`)

    def changing_group(self) -> bool:
        """Whether the drafter group is being stopped: a SIGTERM's stop, or a re-split, a growth or an extra
        drafter waiting for its checkpoint. One change at a time: each of them starts only when this is False."""
        return self.policy.stop_deadline is not None or any(change.stopping is not None for change in self.changes)

    @property
    def targets(self) -> dict[int, Any]:
        """Live (or last known) target handle per slot."""
        return self.fleet.live if self.fleet else {}

    def alive_targets(self) -> list[tuple[int, Any]]:
        """(id, handle) of the targets the policy counts alive, in id order."""
        return [(t, self.targets[t]) for t in self.policy.alive() if t in self.targets]

    # ---- start -----------------------------------------------------------------------------

    def start(self) -> None:
        import ray

        from app.data.costs import sequence_rows

        self.pool = PoolClient(self.topo.make_pool(len(self.cfg.data.bucket_boundaries)), self.cfg.checkpoint.dir)
        self.pool.restore_ledger(self.plan.resume_ledger)
        ds, dcfg = self.plan.dataset, self.cfg.drafter  # each job carries its query rows: the pool deals them
        rows = sequence_rows(ds.loss_mask, ds.offsets, dcfg.block_size, dcfg.num_anchors)
        # One object per epoch (its compact arrays, ~21 bytes per job + 4 per sequence), put once: the pool
        # reads the arrays zero-copy from the object store and makes a JobSpec only when it issues the job.
        # The refs are kept for the run so the objects stay while the pool reads them.
        self.schedule_refs = [ray.put(epoch.with_costs(rows)) for epoch in self.plan.jobs.epochs]
        self._fill_pool(self.plan.resume_ledger)
        self.fleet = Targets(self.plan, self.topo, self.pool, ray.put(self.plan.dataset), self.bundles.wait,
                             self.clock)
        self.group = DrafterGroup(self.plan, self.topo, self.pool, self.monitor, self.bundles, self.log, self.clock)
        if self.planners is not None:
            self.changes = self._elastic(self.planners)
        self._feed_all(self.fleet.start_all())
        self._feed(self.group.start(self.plan.resume_from))

    def _elastic(self, p: Planners) -> tuple:
        """The elastic shells, each handed the started parts it uses: a re-split (topology.rebalance=auto), a growth
        (bundles lost with a node placed again), an extra bundle (topology.max_extra_gpus: free cluster room)."""
        parts = dict(topo=self.topo, group=self.group, pool=self.pool, fleet=self.fleet, policy=self.policy,
                     monitor=self.monitor, clock=self.clock, log=self.log)
        target_ids = itertools.count(self.cfg.topology.num_targets)  # new target slots: ids count on
        return (Resplitter(p.rebalancer, p.advisor, target_ids, **parts), Grower(p.growth, **parts),
                ExtraGpus(p.extra, p.advisor, p.rebalancer, target_ids, self.cfg.topology, **parts))

    def _fill_pool(self, ledger: list[int]) -> None:
        """Restore the ledger into the (new) pool, then queue every epoch: acked jobs are skipped."""
        self.pool.restore_ledger(ledger)
        for ref in self.schedule_refs:
            self.pool.add_epoch(ref, self.plan.bytes_per_token)
        self.pool.finish_adding()

    # ---- loop ------------------------------------------------------------------------------

    def run(self) -> Outcome:
        """Supervise until the drafters finish (or stop); raises RunFailed when the run cannot go on."""
        while True:
            try:
                if self._turn():
                    break
            except PoolDied as exc:  # the policy recreates the pool, or fails with this line
                self._feed(PoolFailed(str(exc)))
        self._status(force=True)
        self.outcome.restarts = self.policy.restarts()
        return self.outcome

    def _turn(self) -> bool:
        """One look at everything; True once the drafters finished."""
        if self.stop_event.is_set():
            self._feed(StopSignal())  # the policy acts on the first one only
        failed, results = self.group.finished(LOOP_WAIT_S)
        stats = self.pool.stats()
        self._drain_records()
        self.monitor.add_pool(stats)
        if results is not None:
            self._drain_records()  # the last step's reports may land after the results
            for change in self.changes:  # the group stopped for a re-split, a growth or an extra rank, not the end
                if change.wants(results):
                    self._feed(change.carry_out())
                    return False
            self._finish(results)
            return True
        self._feed(failed)
        self._feed_all(self._log_restarted(self.fleet.poll_starts()))
        self._note_quarantined(stats)
        for failure in self.watch.new_failures(stats):
            self._feed(failure)
        self._feed_all(self.fleet.watch_idle(stats.oldest_in_flight_age_s))
        self._feed(self.watch.tick(stats, self.monitor.step, self.group.progress()))
        for change in self.changes:
            change.observe(busy=self.changing_group())  # one change at a time: asked again after each
        self._status()
        return False

    def _recreate_pool(self, action: RecreatePool) -> None:
        """A new pool from the checkpoint the group rebuilds from; live targets handed over, the group rebuilt."""
        self.log(f"{action.reason.split('; the run stops here')[0]}; recreating it from the latest checkpoint "
                 f"({action.attempt}/{action.budget}, supervision.max_restarts_pool)")
        ckpt, ledger = self.group.stop_for_rebuild()
        self.pool.recreate(lambda: self.topo.make_pool(len(self.cfg.data.bucket_boundaries)), self.clock)
        self._fill_pool(ledger)
        self.watch.new_pool()  # the new pool's failure list starts empty
        self._hand_over_targets()
        if self.changing_group():
            self.pool.request_stop()  # the dead pool's stop flag went with it
        self.monitor.note(f"pool died -> recreated from {ckpt.name if ckpt else 'scratch'} "
                          f"({action.attempt}/{action.budget})")
        for tid, slot in self.policy.targets.items():  # the dead pool would have reported these
            if slot.state is TargetState.KILLED:
                self._feed(TargetFailed(tid, "killed by the watchdog while the pool died"))
        self._feed(self.group.rebuild(RebuildDrafters("pool recreated", action.attempt, action.budget, kind="pool")))

    def _hand_over_targets(self) -> None:
        """The live targets join the new pool and keep their loaded model; one whose start answered just
        as the pool died (handed to the dead pool only) counts as started now."""
        for tid, handle in sorted(self.fleet.live.items()):
            state = self.policy.targets[tid].state
            if state is TargetState.ALIVE or (state is TargetState.STARTING and tid not in self.fleet.starting):
                self.pool.add_target(tid, handle)
                if state is TargetState.STARTING:
                    self._feed(TargetStarted(tid))

    def _finish(self, results: list[Any]) -> None:
        self.outcome.drafter_results = results
        self.outcome.stopped = any(r.stopped for r in results)
        self.outcome.steps = max(r.steps for r in results)

    def _log_restarted(self, events: list) -> list:
        for event in events:
            if isinstance(event, TargetStarted):
                self.log(f"target {event.target_id} is back")
        return events

    def _drain_records(self) -> None:
        self.group.drain_records()

    def _note_quarantined(self, stats) -> None:
        """A poison job (its forward failed twice) is set aside by the pool; say so once, with its error."""
        for jid, error in self.watch.new_quarantined(stats):
            self.monitor.note(f"job {jid} quarantined after failing twice: {error}")
            self.log(f"WARNING: job {jid} quarantined (its forward failed twice: {error}); it is never "
                     "trained; the run goes on (listed in summary.json quarantined_jobs)")

    # ---- policy ----------------------------------------------------------------------------

    def _feed_all(self, events: list) -> None:
        for event in events:
            self._feed(event)

    def _feed(self, event) -> None:
        """Hand one event (None: nothing happened) to the policy and carry out what it decides."""
        if event is None:
            return
        for action in self.policy.on(event, self.clock()):
            self._act(action)

    def _act(self, action) -> None:
        if isinstance(action, Fail):
            raise RunFailed(action.message)
        if isinstance(action, RestartTarget):
            self.fleet.restart(action.target_id)
            self.monitor.note(f"{action.reason} -> job re-queued, target {action.target_id} restarting "
                              f"({action.attempt}/{action.budget})")
            self.log(f"target {action.target_id} crashed ({action.reason}); its job went back to the queue; "
                     f"restarted ({action.attempt}/{action.budget})")
        elif isinstance(action, GiveUpTarget):
            self.fleet.kill(action.target_id, forget=True)
            self.monitor.note(f"{action.reason} -> restart budget spent ({action.restarts}/{action.budget}), "
                              f"continuing without target {action.target_id}")
            self.log(f"WARNING: target {action.target_id} gave out after {action.restarts} restarts; continuing "
                     f"on {action.alive} targets (supervision.max_restarts_target={action.budget})")
        elif isinstance(action, KillStalledTarget):
            self.log(f"watchdog: target {action.target_id} has had a job for {action.age_s:.0f} s > "
                     f"supervision.stall_timeout_s={self.cfg.supervision.stall_timeout_s:g}; killing it")
            self.monitor.note(f"target {action.target_id} stalled {action.age_s:.0f} s -> killed by the watchdog")
            self.fleet.kill(action.target_id, forget=False)  # the pool sees the error and re-queues the job
        elif isinstance(action, RebuildDrafters):
            self._feed(self.group.rebuild(action))
        elif isinstance(action, RecreatePool):
            self._recreate_pool(action)
        elif isinstance(action, RequestStop):
            self.pool.request_stop()
            self.log("received a stop signal (SIGTERM/SIGINT)")
            self.log(f"stop requested: checkpointing at the next step boundary (within {action.timeout_s:g} s)")
        else:
            raise AssertionError(f"unhandled supervision action {action!r}")

    # ---- status and the end ----------------------------------------------------------------

    def _status(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_status >= self.cfg.logging.status_every_s:
            self.last_status = now
            self.log(self.monitor.line())
            if self.on_status is not None:
                self.on_status(self.monitor.values())

    def evaluate(self, export_dir: str | None) -> TauResult:
        """tau of a fresh drafter and of the exported one on live targets, with the code and spec of
        the evaluations during the run; never raises (see app/run/evaluate/final_tau.py)."""
        final = FinalTau(self.eval_spec, self.cfg.eval.timeout_s, self.clock, self.log)
        return final.measure(self.alive_targets(), export_dir, self.outcome.steps)

    def shutdown(self) -> None:
        import ray

        handles = [*(self.group.ranks if self.group else []), *(self.fleet.handles() if self.fleet else []),
                   *([self.pool.handle] if self.pool else [])]
        for h in handles:
            ray.kill(h, no_restart=True)
