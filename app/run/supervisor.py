"""The driver's supervision loop: start the actors, watch them, restart what dies, stop cleanly.

- Target crash: the pool has already put its jobs back; the target is re-created in its bundle
  (within `supervision.max_restarts_target` per target; 0 = fail fast), else the run goes on
  without it; with no target left the run fails with the actors and errors named.
- Drafter crash: the whole group is torn down, the pool rolls back to the latest checkpoint's
  ledger (jobs trained after it are re-issued), and a new group resumes from that checkpoint.
- Watchdog: a target with a job older than `stall_timeout_s`, or drafters with no step for that
  long while data is waiting, are killed and handled as crashed.
- Stop (SIGTERM): the pool tells rank 0, the group checkpoints at the next step boundary and
  returns; the driver exits 0 and the next submission resumes.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from app.run.plan import RunPlan
from app.run.monitor import RunMonitor
from app.run.topology import Topology


START_TIMEOUT_S = 600.0  # loading a large target or building the drafter group; beyond it something is wrong


class RunFailed(RuntimeError):
    """The run cannot go on; the message is one line naming the actor, the error and the setting."""


@dataclass
class Outcome:
    """How the supervised run ended."""

    stopped: bool = False
    steps: int = 0
    drafter_results: list[Any] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=lambda: {"target": 0, "drafter_group": 0})


class Supervisor:
    """Owns the actor handles of one run and keeps them alive."""

    def __init__(self, plan: RunPlan, topo: Topology, monitor: RunMonitor, stop: threading.Event,
                 log=print) -> None:
        self.plan, self.topo, self.monitor, self.stop_event, self.log = plan, topo, monitor, stop, log
        self.cfg = plan.cfg
        self.sup = plan.cfg.supervision
        self.outcome = Outcome()
        self.targets: dict[int, Any] = {}
        self.target_restarts: dict[int, int] = {}
        self.given_up: set[int] = set()
        self.seen_failures = 0
        self.drafters: list[Any] = []
        self.run_refs: list[Any] = []
        self.last_status = 0.0
        self.stop_sent = False

    # ---- start -----------------------------------------------------------------------------

    def start(self) -> None:
        import ray

        self.dataset_ref = ray.put(self.plan.dataset)
        self.pool = self.topo.make_pool(len(self.cfg.data.bucket_boundaries))
        self._pool_call(self.pool.restore_ledger, self.plan.resume_ledger)
        from app.data.costs import sequence_rows, with_costs

        ds, dcfg = self.plan.dataset, self.cfg.drafter  # each job carries its query rows: the pool deals them
        rows = sequence_rows(ds.loss_mask, ds.offsets, dcfg.block_size, dcfg.num_anchors)
        for i in range(0, len(self.plan.jobs), 4096):  # chunks keep each call's message small
            self._pool_call(self.pool.add_jobs, with_costs(self.plan.jobs[i:i + 4096], rows))
        self._pool_call(self.pool.finish_adding)
        self._start_targets(list(range(self.cfg.topology.num_targets)))
        self._start_drafters(self.plan.resume_from)

    def _start_targets(self, ids: list[int]) -> None:
        """Create the targets together (model loading overlaps), then hand them to the pool."""
        import ray

        from ray.exceptions import GetTimeoutError, RayError

        handles = {i: self.topo.make_target(i, self.plan.model_dir, self.plan.layer_ids, self.dataset_ref,
                                            self.cfg.faults) for i in ids}
        try:  # surface load errors here, not inside the pool
            ray.get([h.ping.remote() for h in handles.values()], timeout=START_TIMEOUT_S)
        except (RayError, GetTimeoutError) as exc:
            raise RunFailed(f"TargetActor {ids} failed to start ({_last_line(exc)}); check model.target="
                            f"{self.cfg.model.target!r} and the topology's resources") from None
        for i, handle in handles.items():
            self.targets[i] = handle
            self._pool_call(self.pool.add_target, i, handle)

    def _start_drafters(self, resume_from: str | None) -> None:
        import ray

        from actors.drafter import DrafterSetup

        p = self.plan
        setup = DrafterSetup(
            world_size=self.cfg.topology.num_drafters, model_dir=p.model_dir, layer_ids=p.layer_ids,
            mask_token_id=p.mask_token_id, drafter=self.cfg.drafter, train=self.cfg.train,
            checkpoint=self.cfg.checkpoint, faults=self.cfg.faults,
            device=self.cfg.topology.device if self.topo.plan.use_gpu else "cpu",
            num_cpus=self.cfg.topology.cpus_per_drafter, dtype=self.cfg.model.dtype,
            total_steps=p.total_steps, resume_from=resume_from, data_fingerprint=p.data_fingerprint,
            eval_every_steps=self.cfg.eval.every_steps,
        )
        from ray.exceptions import GetTimeoutError, RayError

        self.drafters = self.topo.make_drafters(setup, self.pool)
        try:  # setup builds the model and joins the process group: slow on a loaded box
            addr, port = ray.get(self.drafters[0].address.remote(), timeout=START_TIMEOUT_S)
            steps = ray.get([d.setup.remote(addr, port) for d in self.drafters], timeout=START_TIMEOUT_S)
        except (RayError, GetTimeoutError) as exc:
            raise RunFailed(f"DrafterActor group failed to start ({_last_line(exc)})"
                            + (f" while resuming from {resume_from}" if resume_from else "")) from None
        self.monitor.restart_at(steps[0])
        self.log(f"drafter group of {len(self.drafters)} ready at step {steps[0]}"
                 + (f" (resumed from {resume_from})" if resume_from else ""))
        self.run_refs = [d.run.remote() for d in self.drafters]

    # ---- loop ------------------------------------------------------------------------------

    def run(self) -> Outcome:
        """Supervise until the drafters finish (or stop); raises RunFailed when the run cannot go on."""
        import ray

        while True:
            if self.stop_event.is_set() and not self.stop_sent:
                self._request_stop()
            ready, _ = ray.wait(self.run_refs, num_returns=len(self.run_refs), timeout=0.5)
            stats = self._pool_call(self.pool.stats)
            self.monitor.add_records(self._pool_call(self.pool.drain_step_records))
            self.monitor.add_pool(stats)
            if self._drafters_done(ready):
                break
            self._check_targets(stats)
            self._watchdog(stats)
            self._status()
        self._status(force=True)
        return self.outcome

    def _pool_call(self, method, *args) -> Any:
        """Every call to the pool goes through here: a dead pool ends the run with one clear line."""
        import ray
        from ray.exceptions import RayActorError

        try:
            return ray.get(method.remote(*args), timeout=60)
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
            self._restart_drafters(f"drafter crashed: {_last_line(exc)}")
            return False
        if len(results) < len(self.run_refs):
            return False
        self.outcome.drafter_results = ray.get(self.run_refs)
        self.outcome.stopped = any(r.stopped for r in self.outcome.drafter_results)
        self.outcome.steps = max(r.steps for r in self.outcome.drafter_results)
        return True

    def _request_stop(self) -> None:
        import ray

        self._pool_call(self.pool.request_stop)
        self.stop_sent = True
        self.log("received a stop signal (SIGTERM/SIGINT)")
        self.stop_deadline = time.monotonic() + self.sup.stop_timeout_s
        self.log(f"stop requested: checkpointing at the next step boundary (within {self.sup.stop_timeout_s:g} s)")

    # ---- targets ---------------------------------------------------------------------------

    def _check_targets(self, stats) -> None:
        for failure in stats.target_failures[self.seen_failures:]:
            self.seen_failures += 1
            self._handle_target_crash(failure.target_id, str(failure))
        alive = [t for t in self.targets if t not in self.given_up]
        if not alive:
            raise RunFailed(f"no target left: {'; '.join(map(str, stats.target_failures[-3:]))}; raise "
                            f"supervision.max_restarts_target (now {self.sup.max_restarts_target})")

    def _handle_target_crash(self, tid: int, failure: str) -> None:
        import ray

        budget, used = self.sup.max_restarts_target, self.target_restarts.get(tid, 0)
        ray.kill(self.targets[tid], no_restart=True)
        if budget == 0:
            raise RunFailed(f"TargetActor {tid} failed ({failure}) and supervision.max_restarts_target=0; "
                            "raise supervision.max_restarts_target to restart crashed targets")
        if used >= budget:
            self.given_up.add(tid)
            self.monitor.note(f"{failure} -> restart budget spent ({used}/{budget}), continuing without target {tid}")
            self.log(f"WARNING: target {tid} gave out after {used} restarts; continuing on "
                     f"{len(self.targets) - len(self.given_up)} targets (supervision.max_restarts_target={budget})")
            return
        self.target_restarts[tid] = used + 1
        self.outcome.restarts["target"] += 1
        self.pool.report_restart.remote("target")
        self._start_targets([tid])
        self.monitor.note(f"{failure} -> job re-queued, target {tid} restarted ({used + 1}/{budget})")
        self.log(f"target {tid} crashed ({failure}); its job went back to the queue; restarted ({used + 1}/{budget})")

    def _watchdog(self, stats) -> None:
        import ray

        for tid, age in stats.oldest_in_flight_age_s.items():
            if age > self.sup.stall_timeout_s and tid in self.targets and tid not in self.given_up:
                self.log(f"watchdog: target {tid} has had a job for {age:.0f} s > supervision.stall_timeout_s="
                         f"{self.sup.stall_timeout_s:g}; killing it")
                self.monitor.note(f"target {tid} stalled {age:.0f} s -> killed by the watchdog")
                ray.kill(self.targets[tid], no_restart=True)  # the pool sees the error and re-queues the job
        idle = self.monitor.clock() - self.monitor.last_progress
        # Stalled only if a pull could be served now; prefetched leases alone are not "data waiting".
        servable = stats.buffered >= self.cfg.pool.min_ready or (stats.producing_finished and stats.buffered > 0)
        if idle > self.sup.stall_timeout_s and servable:
            self._restart_drafters(f"drafters made no step for {idle:.0f} s with data waiting (watchdog)")
        if self.stop_sent and time.monotonic() > self.stop_deadline:
            raise RunFailed(f"drafters did not checkpoint within supervision.stop_timeout_s={self.sup.stop_timeout_s:g}; "
                            "the last periodic checkpoint stands; raise the timeout if steps are slow")

    # ---- drafters --------------------------------------------------------------------------

    def _restart_drafters(self, reason: str) -> None:
        import ray

        from app.training.checkpoint import latest_checkpoint, read_ledger

        used, budget = self.outcome.restarts["drafter_group"], self.sup.max_restarts_drafter_group
        for d in self.drafters:
            ray.kill(d, no_restart=True)
        # ray.kill is asynchronous: wait until the old ranks are gone, so no late ack or checkpoint
        # lands between reading the checkpoint and rolling the pool back to it.
        ray.wait(self.run_refs, num_returns=len(self.run_refs), timeout=60)
        if used >= budget:
            raise RunFailed(f"DrafterActor group failed ({reason}) and its restart budget is spent ({used}/{budget}); "
                            "raise supervision.max_restarts_drafter_group")
        ckpt = latest_checkpoint(self.cfg.checkpoint.dir)
        ledger = read_ledger(ckpt)[2] if ckpt else list(self.plan.resume_ledger)
        requeued = self._pool_call(self.pool.rollback, ledger)
        self.outcome.restarts["drafter_group"] += 1
        self.pool.report_restart.remote("drafter_group")
        self.monitor.note(f"{reason} -> group rebuilt from {ckpt.name if ckpt else 'scratch'}, "
                          f"{requeued} jobs re-issued ({used + 1}/{budget})")
        self.log(f"{reason}; rebuilding the drafter group from {ckpt or 'scratch'}; {requeued} jobs re-issued "
                 f"({used + 1}/{budget})")
        self._start_drafters(str(ckpt) if ckpt else None)

    # ---- status ----------------------------------------------------------------------------

    def _status(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_status >= self.cfg.logging.status_every_s:
            self.last_status = now
            self.log(self.monitor.line())
            if hasattr(self, "on_status"):
                self.on_status(self.monitor.values())

    def evaluate(self, export_dir: str | None) -> tuple[float | None, float | None]:
        """tau of a fresh drafter and of the exported one, on two live targets in parallel."""
        import ray

        alive = [h for t, h in self.targets.items() if t not in self.given_up]
        if not self.plan.eval_prompts or not alive:
            return None, None
        args = (self.plan.eval_prompts, self.cfg.drafter, self.cfg.eval, self.plan.mask_token_id, self.cfg.train.seed)
        untrained = alive[0].evaluate.remote(None, *args)
        trained = alive[-1].evaluate.remote(export_dir, *args) if export_dir else None
        tau_u = ray.get(untrained)["tau"]
        return tau_u, (ray.get(trained)["tau"] if trained is not None else None)

    def ledger_report(self) -> dict[str, int]:
        stats = self._pool_call(self.pool.stats)
        return {"jobs_acked": stats.acked, "jobs_acked_twice": stats.acked_twice, "jobs_total": stats.total_jobs}

    def shutdown(self) -> None:
        import ray

        for h in [*self.drafters, *self.targets.values(), self.pool]:
            ray.kill(h, no_restart=True)


def _last_line(exc: BaseException) -> str:
    """The last non-empty line of an error: for a Ray task error that is the remote exception itself,
    below the traceback Ray prepends."""
    lines = [l for l in str(exc).splitlines() if l.strip()]
    return lines[-1][:300] if lines else type(exc).__name__
