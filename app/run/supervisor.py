"""The supervision shell of a stream: start the actors, feed what it sees to the policy, carry out its actions.

One road for a single run and a sweep: a stream has runs by name (`{"": plan}` for a single run; app/run/sweep.py
builds the list). `StreamSupervisor` owns what the runs share and decides for it with the target half of the
policy (`TargetPolicy`, app/run/supervise/policy.py, pure); each run is a `RunSupervisor`
(app/run/run_supervisor.py: its drafter group and the drafter half). The actors sit behind helpers that
return the events they saw:
- the pool behind `PoolClient` (app/run/supervise/pool_client.py): retried idempotent calls, a dead pool is
  `RunFailed` with one line; what each of its snapshots says (new target failures and quarantined jobs,
  the policy's `Tick`) is `PoolWatch` (app/run/supervise/pool_watch.py). The stream holds the raw client
  (epochs, targets, recreation); each run a client scoped to it (`RunScoped`);
- the targets behind `Targets` (app/run/supervise/targets.py): start, restart, liveness. A target crash: the
  pool has already put its jobs back; the policy says restart (a new actor in the same bundle,
  started without blocking the loop) or give up; a replacement whose `__init__` fails counts
  against the same budget;
- each run's drafters behind its `DrafterGroup` (app/run/supervise/drafters.py): a crash or stall tears that
  group down, the pool rolls that run back to its latest checkpoint's ledger (jobs trained after it are
  re-issued), and a new group resumes from it.
Each loop turn is every run's turn (its group, its changes, its watchdog), then the stream's target turn.
A pool that died (`PoolDied`) is recreated within `supervision.max_restarts_pool`: a new pool restored from
each run's checkpoint (or the final ledger of a run already done), the live targets handed to it (not
restarted), every unfinished group rebuilt.
"""
from __future__ import annotations

import time
from typing import Any

from app.run.plan import RunPlan
from app.run.run_supervisor import RunSupervisor, StreamParts
from app.run.supervise.drafters import BundleWaits
from app.run.supervise.events import (Fail, GiveUpTarget, KillStalledTarget, PoolFailed, RecreatePool, RestartTarget,
                                      RunFailed, TargetFailed, TargetStarted)
from app.run.supervise.policy import TargetPolicy, TargetState
from app.run.supervise.pool_client import PoolClient, PoolDied
from app.run.supervise.pool_watch import PoolWatch
from app.run.supervise.run_scoped import RunScoped, RunTopology
from app.run.supervise.targets import Targets
from app.run.topology import Topology

LOOP_WAIT_S = 0.5  # each loop turn waits this long for the drafters, shared among the runs' turns


class StreamSupervisor:
    """The pool, the targets, their restarts and watchdog, the pool's recreation; the runs' turns in order."""

    def __init__(self, plan: RunPlan, runs: dict[str, RunSupervisor], topo: Topology, log=print,
                 clock=time.monotonic) -> None:
        """`plan`: the stream's (its target, data, schedule and layers: the union of the runs'); `runs`: each
        run's supervisor by name."""
        self.plan, self.cfg, self.runs, self.topo, self.log, self.clock = plan, plan.cfg, runs, topo, log, clock
        self.policy = TargetPolicy(self.cfg.supervision, self.cfg.topology.num_targets, now=clock())
        self.watch = PoolWatch(self.cfg.pool.min_ready)  # what each pool snapshot says, reported once
        self.bundles = BundleWaits(topo, log)
        self.pool: PoolClient | None = None
        self.fleet: Targets | None = None

    @property
    def targets(self) -> dict[int, Any]:
        """Live (or last known) target handle per slot."""
        return self.fleet.live if self.fleet else {}

    def alive_targets(self) -> list[tuple[int, Any]]:
        """(id, handle) of the targets the policy counts alive, in id order."""
        return [(t, self.targets[t]) for t in self.policy.alive() if t in self.targets]

    # ---- start -----------------------------------------------------------------------------

    def start(self) -> None:
        """The pool with one run per name, each run's slice of the drafter bundles and its ledger, the epochs, the
        targets; the groups start in `run`, where a pool dying meanwhile is recreated."""
        import ray

        from app.data.costs import sequence_rows

        self.pool = PoolClient(self._make_pool(), self.cfg.checkpoint.dir)
        self.fleet = Targets(self.plan, self.topo, self.pool, ray.put(self.plan.dataset), self.bundles.wait,
                             self.clock)
        parts = StreamParts(self.fleet, self.policy, self.bundles, self.alive_targets)
        first = 0
        for name, run in self.runs.items():
            n = run.cfg.topology.num_drafters
            topo = RunTopology(self.topo, self.topo.drafter_bundles[first:first + n])
            run.attach(topo, PoolClient(RunScoped(self.pool.handle, name), run.cfg.checkpoint.dir), parts)
            first += n
        ds, dcfg = self.plan.dataset, self.cfg.drafter  # each job carries its query rows: the pool deals them
        rows = sequence_rows(ds.loss_mask, ds.offsets, dcfg.block_size, dcfg.num_anchors)
        # One object per epoch (its compact arrays, ~21 bytes per job + 4 per sequence), put once: the pool
        # reads the arrays zero-copy from the object store and makes a JobSpec only when it issues the job.
        # The refs are kept for the run so the objects stay while the pool reads them.
        self.schedule_refs = [ray.put(epoch.with_costs(rows)) for epoch in self.plan.jobs.epochs]
        self._fill({name: run.plan.resume_ledger for name, run in self.runs.items()})
        self._feed_all(self.fleet.start_all())

    def _make_pool(self):
        """The pool actor, one run's pool per run of the stream (its ranks and grad_accum size a global step)."""
        from app.pool.stream import RunShape

        shapes = {n: RunShape(r.cfg.topology.num_drafters, r.cfg.train.grad_accum) for n, r in self.runs.items()}
        return self.topo.make_pool(len(self.cfg.data.bucket_boundaries), shapes)

    def _fill(self, ledgers: dict[str, list[int]]) -> None:
        """Restore each run's ledger into the (new) pool, then queue every epoch: acked jobs are skipped."""
        for name, ledger in ledgers.items():
            self.runs[name].pool.restore_ledger(ledger)
        for ref in self.schedule_refs:
            self.pool.add_epoch(ref, self.plan.bytes_per_token)
        self.pool.finish_adding()

    # ---- loop ------------------------------------------------------------------------------

    def run(self) -> None:
        """Supervise until every run's drafters finish (or stop); each run's outcome is on its supervisor.
        Raises RunFailed when the stream cannot go on."""
        while True:
            try:
                if self._turn():
                    break
            except PoolDied as exc:  # the policy recreates the pool, or fails with this line
                self._feed(PoolFailed(str(exc)))
        for run in self.runs.values():  # the stream's restarts are every run's: its jobs went through them
            run.outcome.restarts = {**self.policy.restarts(), **run.policy.restarts()}

    def _turn(self) -> bool:
        """Every run's turn, then the targets'; True once every run's drafters finished."""
        for run in self.runs.values():
            run.start_group()
        wait_s = LOOP_WAIT_S / len(self.runs)
        if all([run.turn(wait_s) for run in self.runs.values()]):
            return True
        self._targets_turn(next(run.stats for run in self.runs.values() if not run.done))
        return False

    def _targets_turn(self, stats) -> None:
        """Target restarts, failures and the target watchdog, from a live run's snapshot (every run's carries the
        stream's target fields)."""
        self._feed_all(self._log_restarted(self.fleet.poll_starts()))
        self._note_quarantined(stats)
        for failure in self.watch.new_failures(stats):
            self._feed(failure)
        self._feed_all(self.fleet.watch_idle(stats.oldest_in_flight_age_s))
        self._feed(self.watch.tick(stats, 0, ()))  # the target half reads the target fields only

    def _recreate_pool(self, action: RecreatePool) -> None:
        """A new pool from each run's checkpoint; the live targets handed over; every unfinished group rebuilt."""
        self.log(f"{action.reason.split('; the run stops here')[0]}; recreating it from the latest checkpoint "
                 f"({action.attempt}/{action.budget}, supervision.max_restarts_pool)")
        stopped = {name: run.stop_for_recreate() for name, run in self.runs.items()}
        self.pool.recreate(self._make_pool, self.clock)
        for name, run in self.runs.items():
            run.pool.replace(RunScoped(self.pool.handle, name))
        self._fill({name: ledger for name, (_, ledger) in stopped.items()})
        self.watch.new_pool()  # the new pool's failure list starts empty
        self._hand_over_targets()
        for run in self.runs.values():
            if run.changing_group():
                run.pool.request_stop()  # the dead pool's stop flag went with it
        for tid, slot in self.policy.targets.items():  # the dead pool would have reported these
            if slot.state is TargetState.KILLED:
                self._feed(TargetFailed(tid, "killed by the watchdog while the pool died"))
        for name, run in self.runs.items():
            run.rebuild_on_new_pool(stopped[name][0], action)

    def _hand_over_targets(self) -> None:
        """The live targets join the new pool and keep their loaded model; one whose start answered just
        as the pool died (handed to the dead pool only) counts as started now."""
        for tid, handle in sorted(self.fleet.live.items()):
            state = self.policy.targets[tid].state
            if state is TargetState.ALIVE or (state is TargetState.STARTING and tid not in self.fleet.starting):
                self.pool.add_target(tid, handle)
                if state is TargetState.STARTING:
                    self._feed(TargetStarted(tid))

    def _log_restarted(self, events: list) -> list:
        for event in events:
            if isinstance(event, TargetStarted):
                self.log(f"target {event.target_id} is back")
        return events

    def _note(self, text: str) -> None:
        """A stream's fault goes into every run's fault log: each run's jobs went through it."""
        for run in self.runs.values():
            run.monitor.note(text)

    def _note_quarantined(self, stats) -> None:
        """A poison job (its forward failed twice) is set aside by the pool; say so once, with its error."""
        for jid, error in self.watch.new_quarantined(stats):
            self._note(f"job {jid} quarantined after failing twice: {error}")
            self.log(f"WARNING: job {jid} quarantined (its forward failed twice: {error}); it is never "
                     "trained; the run goes on (listed in summary.json quarantined_jobs)")

    # ---- policy ----------------------------------------------------------------------------

    def _feed_all(self, events: list) -> None:
        for event in events:
            self._feed(event)

    def _feed(self, event) -> None:
        """Hand one event (None: nothing happened) to the target half and carry out what it decides."""
        if event is None:
            return
        for action in self.policy.on(event, self.clock()):
            self._act(action)

    def _act(self, action) -> None:
        if isinstance(action, Fail):
            raise RunFailed(action.message)
        if isinstance(action, RestartTarget):
            self.fleet.restart(action.target_id)
            for run in self.runs.values():  # dflash_restarts_total{kind="target"}, in every run's metrics
                run.pool.report_restart("target")
            self._note(f"{action.reason} -> job re-queued, target {action.target_id} restarting "
                       f"({action.attempt}/{action.budget})")
            self.log(f"target {action.target_id} crashed ({action.reason}); its job went back to the queue; "
                     f"restarted ({action.attempt}/{action.budget})")
        elif isinstance(action, GiveUpTarget):
            self.fleet.kill(action.target_id, forget=True)
            self._note(f"{action.reason} -> restart budget spent ({action.restarts}/{action.budget}), "
                       f"continuing without target {action.target_id}")
            self.log(f"WARNING: target {action.target_id} gave out after {action.restarts} restarts; continuing "
                     f"on {action.alive} targets (supervision.max_restarts_target={action.budget})")
        elif isinstance(action, KillStalledTarget):
            self.log(f"watchdog: target {action.target_id} has had a job for {action.age_s:.0f} s > "
                     f"supervision.stall_timeout_s={self.cfg.supervision.stall_timeout_s:g}; killing it")
            self._note(f"target {action.target_id} stalled {action.age_s:.0f} s -> killed by the watchdog")
            self.fleet.kill(action.target_id, forget=False)  # the pool sees the error and re-queues the job
        elif isinstance(action, RecreatePool):
            self._recreate_pool(action)
        else:
            raise AssertionError(f"unhandled target supervision action {action!r}")

    def shutdown(self) -> None:
        import ray

        handles = [*(r for run in self.runs.values() if run.group for r in run.group.ranks),
                   *(self.fleet.handles() if self.fleet else []), *([self.pool.handle] if self.pool else [])]
        for h in handles:
            ray.kill(h, no_restart=True)
