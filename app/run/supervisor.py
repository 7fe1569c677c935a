"""The supervision shell: start the actors, feed what it sees to the policy, carry out its actions with Ray.

The decisions (restart or give up a target, rebuild the drafter group, watchdog verdicts, stop,
fail) live in `app/run/supervision.py`, a pure class; this module only observes and acts:
- Target crash: the pool has already put its jobs back; the policy says restart (a new actor in
  the same bundle, started without blocking the loop) or give up; a replacement whose `__init__`
  fails counts against the same budget.
- Drafter crash or stall: the whole group is torn down, the pool rolls back to the latest
  checkpoint's ledger (jobs trained after it are re-issued), and a new group resumes from it.
- Stop (SIGTERM): the pool tells rank 0, the group checkpoints at the next step boundary and
  returns; the driver exits 0 and the next submission resumes.
"""
from __future__ import annotations

import threading
from pathlib import Path
import time
from dataclasses import dataclass, field, replace
from typing import Any

from app.messages import DrafterPhase
from app.training.step_log import FILE_NAME as STEP_LOG_FILE, StepLog
from app.run.plan import RunPlan
from app.run.monitor import RunMonitor
from app.run.supervision import (DrafterGroupFailed, DrafterGroupStarted, Fail, GiveUpTarget, KillStalledTarget,
                                  RankProgress, RebuildDrafters, RequestStop, RestartTarget, StopSignal, SupervisionPolicy,
                                  TargetFailed, TargetStarted, TargetStartFailed, Tick)
from app.run.topology import Topology


START_TIMEOUT_S = 600.0  # loading a large target or building the drafter group; beyond it something is wrong


PROGRESS_TIMEOUT_S = 30.0  # a drafter rank that does not answer a progress query this long is unresponsive
EVAL_TIMEOUT_S = 900.0  # one tau measurement on one target; past it the target counts as hung
BUNDLE_WAIT_S = 90.0  # after a node loss: how long a restart waits for its bundle to be re-placed on a live node
LIVENESS_EVERY_S = 5.0  # how often an idle target is pinged (a dead one is otherwise noticed only by its next job)


class RunFailed(RuntimeError):
    """The run cannot go on; the message is one line naming the actor, the error and the setting."""


@dataclass
class Outcome:
    """How the supervised run ended."""

    stopped: bool = False
    steps: int = 0
    drafter_results: list[Any] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=lambda: {"target": 0, "drafter_group": 0})


@dataclass(frozen=True)
class _PendingStart:
    """A target actor created but not yet answering: its handle, first ping and creation time."""

    handle: Any
    ping: Any
    since: float


@dataclass(frozen=True)
class TauResult:
    """Acceptance lengths of the untrained and the trained drafter; `reason` says why one is None."""

    untrained: float | None
    trained: float | None
    reason: str | None = None


class Supervisor:
    """Owns the actor handles of one run; observes them and carries out the policy's actions."""

    def __init__(self, plan: RunPlan, topo: Topology, monitor: RunMonitor, stop: threading.Event,
                 log=print, clock=time.monotonic) -> None:
        self.plan, self.topo, self.monitor, self.stop_event, self.log = plan, topo, monitor, stop, log
        self.cfg = plan.cfg
        self.sup = plan.cfg.supervision
        self.clock = clock
        self.policy = SupervisionPolicy(self.sup, self.cfg.topology.num_targets, now=clock())
        self.outcome = Outcome()
        self.targets: dict[int, Any] = {}  # live (or last known) handle per target slot
        self.starting: dict[int, _PendingStart] = {}
        self.seen_failures = 0
        self.drafters: list[Any] = []
        self.run_refs: list[Any] = []
        self.last_status = 0.0
        self.eval_timeout_s = EVAL_TIMEOUT_S
        self.progress_query: dict[int, tuple[Any, float]] = {}  # rank -> (pending progress() ref, sent at)
        self.progress_seen: dict[int, RankProgress] = {}
        self.quarantined_seen: set[int] = set()
        self.liveness: dict[int, tuple[Any, Any, float]] = {}  # target -> (handle pinged, ping ref, sent at)
        self.lost_bundles: set[int] = set()  # bundles a node loss left without a node at the last wait
        self.step_log = StepLog(Path(self.cfg.checkpoint.dir) / STEP_LOG_FILE) \
            if self.cfg.logging.step_log and "://" not in str(self.cfg.checkpoint.dir) else None

    # ---- start -----------------------------------------------------------------------------

    def start(self) -> None:
        import ray

        self.dataset_ref = ray.put(self.plan.dataset)
        self.pool = self.topo.make_pool(len(self.cfg.data.bucket_boundaries))
        self._pool_call(self.pool.restore_ledger, self.plan.resume_ledger)
        from app.data.costs import sequence_rows

        ds, dcfg = self.plan.dataset, self.cfg.drafter  # each job carries its query rows: the pool deals them
        rows = sequence_rows(ds.loss_mask, ds.offsets, dcfg.block_size, dcfg.num_anchors)
        # One object per epoch (its compact arrays, ~21 bytes per job + 4 per sequence), put once: the pool
        # reads the arrays zero-copy from the object store and makes a JobSpec only when it issues the job.
        # The refs are kept for the run so the objects stay while the pool reads them.
        self.schedule_refs = [ray.put(epoch.with_costs(rows)) for epoch in self.plan.jobs.epochs]
        for ref in self.schedule_refs:
            self._pool_call(self.pool.add_epoch, ref, self.plan.bytes_per_token)
        self._pool_call(self.pool.finish_adding)
        self._start_first_targets()
        self._start_drafters(self.plan.resume_from)

    def _start_first_targets(self) -> None:
        """Create all targets together (model loading overlaps) and wait for them once. All failing
        is a setup error (wrong model, no resources): one line. Some failing is a fault for the policy."""
        import ray

        ids = list(range(self.cfg.topology.num_targets))
        for i in ids:
            self._launch_target(i)
        ray.wait([p.ping for p in self.starting.values()], num_returns=len(ids), timeout=START_TIMEOUT_S)
        errors = {i: self._start_result(i, decide_now=True) for i in ids}
        failed = {i: e for i, e in errors.items() if e is not None}
        if len(failed) == len(ids):
            raise RunFailed(f"TargetActor {ids} failed to start ({next(iter(failed.values()))}); check "
                            f"model.target={self.cfg.model.target!r} and the topology's resources")
        for i in ids:
            self._feed(TargetStartFailed(i, failed[i]) if i in failed else TargetStarted(i))

    def _launch_target(self, tid: int) -> None:
        """Create the target actor and send its first ping; the answer is collected by the loop."""
        handle = self.topo.make_target(tid, self.plan.model_dir, self.plan.layer_ids, self.dataset_ref,
                                       self.cfg.faults)
        self.starting[tid] = _PendingStart(handle, handle.ping.remote(), self.clock())

    def _start_result(self, tid: int, decide_now: bool) -> str | None:
        """None when target `tid` started (it is handed to the pool); else why it did not. A start
        still loading gives "loading" unless `decide_now` or START_TIMEOUT_S has passed."""
        import ray

        from ray.exceptions import RayError

        pending = self.starting.get(tid)
        if pending is None:
            return None
        done, _ = ray.wait([pending.ping], timeout=0)
        if not done and not decide_now and self.clock() - pending.since < START_TIMEOUT_S:
            return "loading"
        del self.starting[tid]
        try:
            ray.get(pending.ping, timeout=None if done else 0)
        except (RayError, ray.exceptions.GetTimeoutError) as exc:
            ray.kill(pending.handle, no_restart=True)
            return _last_line(exc) if done else f"no answer within {START_TIMEOUT_S:g} s"
        self.targets[tid] = pending.handle
        self._pool_call(self.pool.add_target, tid, pending.handle)
        return None

    def _poll_starts(self) -> None:
        for tid in list(self.starting):
            err = self._start_result(tid, decide_now=False)
            if err == "loading":
                continue
            if err is None:
                self.log(f"target {tid} is back")
            self._feed(TargetStartFailed(tid, f"restart failed: {err}") if err else TargetStarted(tid))

    def _start_drafters(self, resume_from: str | None, rebuilding: bool = False,
                        bundles: list[int] | None = None) -> None:
        """Build the group and start its training loop. A first start that fails is a setup error
        (one line); a rebuild that fails (a rank killed while joining) is one more group failure."""
        import ray

        from actors.drafter import DrafterSetup

        p = self.plan
        setup = DrafterSetup(
            world_size=len(bundles) if bundles else self.cfg.topology.num_drafters, model_dir=p.model_dir,
            layer_ids=p.layer_ids,
            mask_token_id=p.mask_token_id, drafter=self.cfg.drafter, train=self.cfg.train,
            checkpoint=self.cfg.checkpoint, faults=self.cfg.faults,
            device=self.cfg.topology.device if self.topo.plan.use_gpu else "cpu",
            num_cpus=self.cfg.topology.cpus_per_drafter, dtype=self.cfg.model.dtype,
            total_steps=p.total_steps, total_jobs=len(p.jobs), resume_from=resume_from, data_fingerprint=p.data_fingerprint,
            eval_every_steps=self.cfg.eval.every_steps, step_log=str(self.step_log.path) if self.step_log else None,
        )
        from ray.exceptions import GetTimeoutError, RayError

        self.drafters = self.topo.make_drafters(setup, self.pool, bundles)
        self.progress_query, self.progress_seen = {}, {}
        try:  # setup builds the model and joins the process group: slow on a loaded box
            addr, port = ray.get(self.drafters[0].address.remote(), timeout=START_TIMEOUT_S)
            ready = ray.get([d.setup.remote(addr, port) for d in self.drafters], timeout=START_TIMEOUT_S)
        except (RayError, GetTimeoutError) as exc:
            if rebuilding:
                self.run_refs = []
                for d in self.drafters:
                    ray.kill(d, no_restart=True)
                self._feed(DrafterGroupFailed(f"group rebuild failed: {_last_line(exc)}"))
                return
            raise RunFailed(f"DrafterActor group failed to start ({_last_line(exc)})"
                            + (f" while resuming from {resume_from}" if resume_from else "")) from None
        step, checksums = ready[0][0], sorted({round(c, 6) for _, c in ready})
        self.monitor.restart_at(step)
        if self.step_log:
            self.step_log.group_start(step)
        self._feed(DrafterGroupStarted(step))
        self.log(f"drafter group of {len(self.drafters)} ready at step {step}"
                 + (f" (resumed from {resume_from})" if resume_from else "")
                 + f"; weights checksum {' '.join(f'{c:.6f}' for c in checksums)}")
        # The pool sizes each global step (ranks x grad_accum) for its pull policy: a group rebuilt on
        # fewer GPUs would otherwise be dealt steps for ranks that no longer exist.
        self._pool_call(self.pool.set_ranks, len(self.drafters))
        self.run_refs = [d.run.remote() for d in self.drafters]

    # ---- loop ------------------------------------------------------------------------------

    def run(self) -> Outcome:
        """Supervise until the drafters finish (or stop); raises RunFailed when the run cannot go on."""
        import ray

        while True:
            if self.stop_event.is_set():
                self._feed(StopSignal())  # the policy acts on the first one only
            ready, _ = ray.wait(self.run_refs, num_returns=len(self.run_refs), timeout=0.5)
            stats = self._pool_call(self.pool.stats)
            self._drain_records()
            self.monitor.add_pool(stats)
            if self._drafters_done(ready):
                self._drain_records()  # the last step's reports may land after the results
                break
            self._poll_starts()
            self._note_quarantined(stats)
            for failure in stats.target_failures[self.seen_failures:]:
                self.seen_failures += 1
                self._feed(TargetFailed(failure.target_id, str(failure)))
            self._watch_idle_targets(stats)
            self._feed(self._tick(stats))
            self._status()
        self._status(force=True)
        self.outcome.restarts = self.policy.restarts()
        return self.outcome

    def _watch_idle_targets(self, stats) -> None:
        """Ping every live target now and then; one that died holding no job (its node went away while
        it was idle) is a TargetFailed like any other. A target with a job in flight is left to the pool,
        whose failing call reports it (the same death must not be restarted twice)."""
        import ray

        from ray.exceptions import RayError

        now = self.clock()
        for tid, handle in list(self.targets.items()):
            pinged, ref, sent = self.liveness.get(tid, (None, None, 0.0))
            if pinged is not handle:  # a new incarnation (or never pinged): start afresh
                if now - sent >= LIVENESS_EVERY_S or pinged is None:
                    self.liveness[tid] = (handle, handle.ping.remote(), now)
                continue
            done, _ = ray.wait([ref], timeout=0)
            if not done:
                continue
            try:
                ray.get(ref)
            except RayError as exc:
                if tid not in stats.oldest_in_flight_age_s:
                    del self.liveness[tid]
                    self._feed(TargetFailed(tid, f"target {tid} died while idle ({_last_line(exc)})"))
                continue
            if now - sent >= LIVENESS_EVERY_S:
                self.liveness[tid] = (handle, handle.ping.remote(), now)

    def _drain_records(self) -> None:
        records = self._pool_call(self.pool.drain_step_records)
        self.monitor.add_records(records)

    def _note_quarantined(self, stats) -> None:
        """A poison job (its forward failed twice) is set aside by the pool; say so once, with its error."""
        for jid, error in sorted(stats.quarantined.items()):
            if jid not in self.quarantined_seen:
                self.quarantined_seen.add(jid)
                self.monitor.note(f"job {jid} quarantined after failing twice: {error}")
                self.log(f"WARNING: job {jid} quarantined (its forward failed twice: {error}); it is never "
                         "trained; the run goes on (listed in summary.json quarantined_jobs)")

    def _tick(self, stats) -> Tick:
        # Servable: a pull could be served now; prefetched leases alone are not "data waiting".
        servable = stats.buffered >= self.cfg.pool.min_ready or (stats.producing_finished and stats.buffered > 0)
        return Tick(dict(stats.oldest_in_flight_age_s), servable, self.monitor.step, self._rank_progress())

    def _rank_progress(self) -> tuple[RankProgress, ...]:
        """Each rank's latest answer to a progress query, one query in flight per rank; a rank whose
        query is unanswered for PROGRESS_TIMEOUT_S is UNRESPONSIVE (frozen process, wedged node)."""
        import ray

        from ray.exceptions import RayError

        now = self.clock()
        for rank, drafter in enumerate(self.drafters):
            if rank not in self.progress_query:
                self.progress_query[rank] = (drafter.progress.remote(), now)
            ref, sent = self.progress_query[rank]
            done, _ = ray.wait([ref], timeout=0)
            if done:
                del self.progress_query[rank]
                try:
                    p = ray.get(ref)
                except RayError:  # the rank died: its run() reference reports that to the loop
                    continue
                self.progress_seen[rank] = RankProgress(rank, p.phase, p.age_s, p.step)
            elif now - sent > PROGRESS_TIMEOUT_S:
                self.progress_seen[rank] = RankProgress(rank, DrafterPhase.UNRESPONSIVE, now - sent)
        return tuple(self.progress_seen[r] for r in sorted(self.progress_seen))

    def _feed(self, event) -> None:
        """Hand one event to the policy and carry out what it decides."""
        for action in self.policy.on(event, self.clock()):
            self._act(action)

    def _act(self, action) -> None:
        import ray

        if isinstance(action, Fail):
            raise RunFailed(action.message)
        if isinstance(action, RestartTarget):
            self._kill(self.targets.pop(action.target_id, None))
            self.pool.report_restart.remote("target")
            self._wait_for_bundles([self.topo.plan.target_bundle(action.target_id)], timeout_s=30.0)  # loop blocks
            self._launch_target(action.target_id)
            self.monitor.note(f"{action.reason} -> job re-queued, target {action.target_id} restarting "
                              f"({action.attempt}/{action.budget})")
            self.log(f"target {action.target_id} crashed ({action.reason}); its job went back to the queue; "
                     f"restarted ({action.attempt}/{action.budget})")
        elif isinstance(action, GiveUpTarget):
            self._kill(self.targets.pop(action.target_id, None))
            self.monitor.note(f"{action.reason} -> restart budget spent ({action.restarts}/{action.budget}), "
                              f"continuing without target {action.target_id}")
            self.log(f"WARNING: target {action.target_id} gave out after {action.restarts} restarts; continuing "
                     f"on {action.alive} targets (supervision.max_restarts_target={action.budget})")
        elif isinstance(action, KillStalledTarget):
            self.log(f"watchdog: target {action.target_id} has had a job for {action.age_s:.0f} s > "
                     f"supervision.stall_timeout_s={self.sup.stall_timeout_s:g}; killing it")
            self.monitor.note(f"target {action.target_id} stalled {action.age_s:.0f} s -> killed by the watchdog")
            self._kill(self.targets.get(action.target_id))  # the pool sees the error and re-queues the job
        elif isinstance(action, RebuildDrafters):
            self._rebuild_drafters(action)
        elif isinstance(action, RequestStop):
            self._pool_call(self.pool.request_stop)
            self.log("received a stop signal (SIGTERM/SIGINT)")
            self.log(f"stop requested: checkpointing at the next step boundary (within {action.timeout_s:g} s)")
        else:
            raise AssertionError(f"unhandled supervision action {action!r}")

    @staticmethod
    def _kill(handle) -> None:
        import ray

        if handle is not None:
            ray.kill(handle, no_restart=True)

    # Pool calls that are safe to send twice. Ray raises ActorUnavailableError for a connection that
    # blips (seen once in four node-loss runs) without saying whether the call ran, so only these retry.
    _IDEMPOTENT_POOL_CALLS = frozenset({"stats", "request_stop", "finish_adding", "pause_target", "resume_target",
                                        "set_ranks"})

    def _pool_call(self, method, *args) -> Any:
        """Every call to the pool goes through here: a dead pool ends the run with one clear line."""
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError

        retries = 5 if getattr(method, "_method_name", "") in self._IDEMPOTENT_POOL_CALLS else 0
        try:
            for attempt in range(retries + 1):
                try:
                    return ray.get(method.remote(*args), timeout=60)
                except ActorUnavailableError:
                    if attempt == retries:
                        raise
                    time.sleep(2.0)
        except (RayActorError, ray.exceptions.GetTimeoutError) as exc:
            from app.training.checkpoint import latest_checkpoint

            ckpt = latest_checkpoint(self.cfg.checkpoint.dir)
            raise RunFailed(
                f"pool actor HSPoolActor died ({type(exc).__name__}); the run stops here. Resubmit the same "
                f"command to resume from {ckpt or 'the start (no checkpoint yet)'}"
            ) from None

    def _drafters_done(self, ready: list[Any]) -> bool:
        import ray
        from ray.exceptions import RayError

        if not ready:
            return False
        try:
            results = ray.get(ready)
        except RayError as exc:
            self._feed(DrafterGroupFailed(f"drafter crashed: {_last_line(exc)}"))
            return False
        if len(results) < len(self.run_refs):
            return False
        self.outcome.drafter_results = ray.get(self.run_refs)
        self.outcome.stopped = any(r.stopped for r in self.outcome.drafter_results)
        self.outcome.steps = max(r.steps for r in self.outcome.drafter_results)
        return True

    # ---- drafters --------------------------------------------------------------------------

    def _rebuild_drafters(self, action: RebuildDrafters) -> None:
        import ray

        from app.training.checkpoint import latest_checkpoint, read_ledger

        for d in self.drafters:
            ray.kill(d, no_restart=True)
        # ray.kill is asynchronous: wait until the old ranks are gone, so no late ack or checkpoint
        # lands between reading the checkpoint and rolling the pool back to it.
        if self.run_refs:
            ray.wait(self.run_refs, num_returns=len(self.run_refs), timeout=60)
        self._drain_records()  # the dead group's last reports belong before the new group's start
        ckpt = latest_checkpoint(self.cfg.checkpoint.dir)
        ledger = read_ledger(ckpt)[2] if ckpt else list(self.plan.resume_ledger)
        requeued = self._pool_call(self.pool.rollback, ledger)
        self.pool.report_restart.remote("drafter_group")
        self.monitor.note(f"{action.reason} -> group rebuilt from {ckpt.name if ckpt else 'scratch'}, "
                          f"{requeued} jobs re-issued ({action.attempt}/{action.budget})")
        self.log(f"{action.reason}; rebuilding the drafter group from {ckpt or 'scratch'}; {requeued} jobs "
                 f"re-issued ({action.attempt}/{action.budget})")
        bundles = [self.topo.plan.drafter_bundle(r) for r in range(self.topo.plan.num_drafters)]
        missing = self._wait_for_bundles(bundles)
        placed = [b for b in bundles if b not in missing]
        if missing and placed:  # a lost node took GPUs nobody can replace: go on with fewer ranks
            self.log(f"rebuilding the drafter group with {len(placed)} of {len(bundles)} ranks: bundles {missing} "
                     "have no node (the LR schedule runs on jobs, so fewer ranks only slow the run)")
            self.monitor.note(f"drafter group shrunk to {len(placed)} ranks (bundles {missing} lost with a node)")
        self._start_drafters(str(ckpt) if ckpt else None, rebuilding=True, bundles=placed or bundles)

    def _wait_for_bundles(self, bundles: list[int], timeout_s: float = BUNDLE_WAIT_S) -> list[int]:
        """Before a restart: a bundle on a lost node is re-placed by Ray once the GCS notices the death;
        an actor created into it earlier is cancelled, which would spend a restart for nothing."""
        missing = self.topo.wait_bundles(bundles, 5.0)  # placed ones answer at once
        if missing and not set(missing) <= self.lost_bundles:  # newly lost: give Ray time to re-place them
            missing = self.topo.wait_bundles(missing, timeout_s)
        self.lost_bundles = (self.lost_bundles - set(bundles)) | set(missing)
        if missing:
            self.log(f"WARNING: bundles {missing} not placed on a live node within {timeout_s:g} s (the cluster "
                     "has no room for a lost node's share)")
        return missing

    # ---- status ----------------------------------------------------------------------------

    def _status(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_status >= self.cfg.logging.status_every_s:
            self.last_status = now
            self.log(self.monitor.line())
            if hasattr(self, "on_status"):
                self.on_status(self.monitor.values())

    def evaluate(self, export_dir: str | None) -> TauResult:
        """tau of a fresh drafter and of the exported one, each on a live target with a timeout; a
        target that died or hangs is skipped for the next one. Never raises: what could not be
        measured is None with the reason, so the summary is written whatever happens here."""
        alive = [(t, self.targets[t]) for t in self.policy.alive() if t in self.targets]
        if not self.plan.eval_prompts:
            return TauResult(None, None, "no eval prompts")
        if not alive:
            return TauResult(None, None, "no live target left to measure tau on")
        args = (self.plan.eval_prompts, self.cfg.drafter, self.cfg.eval, self.plan.mask_token_id, self.cfg.train.seed)
        # Untrained and trained start together on two different targets (when there are two).
        first_u = alive[0][1].evaluate.remote(None, *args)
        first_t = alive[-1][1].evaluate.remote(export_dir, *args) if export_dir else None
        started = self.clock()
        tau_u, why_u = self._tau_on(alive, None, args, first_u, started)
        tau_t, why_t = self._tau_on(alive[::-1], export_dir, args, first_t, started) if export_dir \
            else (None, "nothing was exported")
        reason = "; ".join(f"{k}: {w}" for k, w in (("untrained", why_u), ("trained", why_t)) if w)
        return TauResult(tau_u, tau_t, reason or None)

    def _tau_on(self, candidates: list[tuple[int, Any]], drafter_dir: str | None, args: tuple, first_ref: Any,
                started: float) -> tuple[float | None, str | None]:
        """tau from the first candidate that answers in time; `first_ref` is already running on candidates[0]."""
        import ray

        from ray.exceptions import GetTimeoutError, RayError

        errors = []
        for i, (tid, handle) in enumerate(candidates):
            ref = first_ref if i == 0 else handle.evaluate.remote(drafter_dir, *args)
            began = started if i == 0 else self.clock()
            try:
                left = max(0.0, self.eval_timeout_s - (self.clock() - began))
                return float(ray.get(ref, timeout=left)["tau"]), None
            except GetTimeoutError:
                ray.cancel(ref, force=True)
                errors.append(f"target {tid} gave no answer within {self.eval_timeout_s:g} s")
            except RayError as exc:
                errors.append(f"target {tid}: {_last_line(exc)}")
            self.log(f"WARNING: tau evaluation on target {tid} failed ({errors[-1]}); trying the next target")
        return None, "; ".join(errors)

    def ledger_report(self) -> dict[str, Any]:
        stats = self._pool_call(self.pool.stats)
        return {"jobs_acked": stats.acked, "jobs_acked_twice": stats.acked_twice, "jobs_total": stats.total_jobs,
                "jobs_quarantined": len(stats.quarantined),
                "quarantined_jobs": [{"job_id": j, "error": e} for j, e in sorted(stats.quarantined.items())]}

    def shutdown(self) -> None:
        import ray

        for h in [*self.drafters, *self.targets.values(), *(p.handle for p in self.starting.values()), self.pool]:
            ray.kill(h, no_restart=True)


def _last_line(exc: BaseException) -> str:
    """The last non-empty line of an error: for a Ray task error that is the remote exception itself,
    below the traceback Ray prepends."""
    lines = [l for l in str(exc).splitlines() if l.strip()]
    return lines[-1][:300] if lines else type(exc).__name__
