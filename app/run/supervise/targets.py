"""The run's TargetActors: start, restart, liveness. The shell around them; the policy decides.

Every method returns the supervision events it saw (`TargetStarted`, `TargetStartFailed`,
`TargetFailed`), in order, for the stream's supervisor to hand to its `TargetPolicy`:
- a start (first or restart) is an actor plus its first ping; the loop collects the answer without
  blocking, so a restart that loads for minutes never stalls supervision;
- a target that started is handed to the pool (`add_target`);
- live targets are pinged now and then: one that died idle (its node went away between jobs) is
  otherwise noticed only by its next job.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from app.run.supervise.events import RunFailed, last_line
from app.run.supervise.events import TargetFailed, TargetStartFailed, TargetStarted

START_TIMEOUT_S = 600.0  # loading a large target or building the drafter group; beyond it something is wrong
LIVENESS_EVERY_S = 5.0  # how often an idle target is pinged
RESTART_BUNDLE_WAIT_S = 30.0  # a target restart blocks the loop this long at most for its bundle


@dataclass(frozen=True)
class _PendingStart:
    """A target actor created but not yet answering: its handle, first ping and creation time."""

    handle: Any
    ping: Any
    since: float


class Targets:
    """The target slots: live handles, starts still loading, and the liveness ping in flight per target."""

    def __init__(self, plan, topo, pool, dataset_ref: Any, wait_bundles: Callable[[list[int], float], list[int]],
                 clock: Callable[[], float]) -> None:
        self.plan, self.topo, self.pool, self.dataset_ref = plan, topo, pool, dataset_ref
        self.wait_bundles, self.clock = wait_bundles, clock
        self.live: dict[int, Any] = {}  # live (or last known) handle per target slot
        self.starting: dict[int, _PendingStart] = {}
        self.liveness: dict[int, tuple[Any, Any, float]] = {}  # target -> (handle pinged, ping ref, sent at)

    def start_all(self) -> list:
        """Create all targets together (model loading overlaps) and wait for them once. All failing is a
        setup error (wrong model, no resources): RunFailed, one line. Some failing is a fault for the policy."""
        import ray

        ids = list(range(self.plan.cfg.topology.num_targets))
        for tid in ids:
            self._launch(tid)
        ray.wait([p.ping for p in self.starting.values()], num_returns=len(ids), timeout=START_TIMEOUT_S)
        failed = {tid: err for tid in ids if (err := self._start_result(tid, decide_now=True)) is not None}
        if len(failed) == len(ids):
            raise RunFailed(f"TargetActor {ids} failed to start ({next(iter(failed.values()))}); check "
                            f"model.target={self.plan.cfg.model.target!r} and the topology's resources")
        return [TargetStartFailed(tid, failed[tid]) if tid in failed else TargetStarted(tid) for tid in ids]

    def poll_starts(self) -> list:
        """Events for the (re)starts that answered, failed or ran out of time since the last poll."""
        events = []
        for tid in list(self.starting):
            err = self._start_result(tid, decide_now=False)
            if err != "loading":
                events.append(TargetStartFailed(tid, f"restart failed: {err}") if err else TargetStarted(tid))
        return events

    def restart(self, tid: int) -> None:
        """Kill what is left of target `tid` and start a new one in its bundle (its answer comes via poll_starts).
        The stream's supervisor counts the restart in each run's metrics."""
        self.kill(tid, forget=True)
        self.wait_bundles([self.topo.target_bundle(tid)], RESTART_BUNDLE_WAIT_S)  # the loop blocks
        self._launch(tid)

    def add(self, tid: int) -> None:
        """A new target slot (a re-split gave the targets a bundle): start it; its answer comes via poll_starts."""
        self._launch(tid)

    def retire(self, tid: int) -> None:
        """Target `tid` leaves the run (a re-split gives its bundle to the drafters): the pool already
        took it off (`remove_target`, its jobs re-queued); kill it and forget it, pings included."""
        self.kill(tid, forget=True)
        pending = self.starting.pop(tid, None)
        if pending is not None:
            import ray

            ray.kill(pending.handle, no_restart=True)
        self.liveness.pop(tid, None)

    def kill(self, tid: int, forget: bool) -> None:
        """Kill target `tid`; `forget` drops its handle (given up, or about to be replaced)."""
        import ray

        handle = self.live.pop(tid, None) if forget else self.live.get(tid)
        if handle is not None:
            ray.kill(handle, no_restart=True)

    def watch_idle(self, busy: dict[int, float]) -> list:
        """Ping every live target now and then; one that died holding no job is a TargetFailed. A target
        with a job in flight (`busy`) is left to the pool, whose failing call reports it (the same death
        must not be restarted twice)."""
        import ray
        from ray.exceptions import RayError

        now, events = self.clock(), []
        for tid, handle in list(self.live.items()):
            pinged, ref, sent = self.liveness.get(tid, (None, None, 0.0))
            if pinged is not handle:  # a new incarnation (or never pinged): start afresh
                if now - sent >= LIVENESS_EVERY_S or pinged is None:
                    self.liveness[tid] = (handle, handle.ping.remote(), now)
                continue
            if not ray.wait([ref], timeout=0)[0]:
                continue
            try:
                ray.get(ref)
            except RayError as exc:
                if tid not in busy:
                    del self.liveness[tid]
                    events.append(TargetFailed(tid, f"target {tid} died while idle ({last_line(exc)})"))
                continue
            if now - sent >= LIVENESS_EVERY_S:
                self.liveness[tid] = (handle, handle.ping.remote(), now)
        return events

    def handles(self) -> list[Any]:
        """Every target actor this run still holds, started or loading (for shutdown)."""
        return [*self.live.values(), *(p.handle for p in self.starting.values())]

    # ---- steps ----------------------------------------------------------------------------

    def _launch(self, tid: int) -> None:
        """Create the target actor and send its first ping; the answer is collected later."""
        plan = self.plan
        handle = self.topo.make_target(tid, plan.model_dir, plan.layer_ids, self.dataset_ref, plan.cfg.faults)
        self.starting[tid] = _PendingStart(handle, handle.ping.remote(), self.clock())

    def _start_result(self, tid: int, decide_now: bool) -> str | None:
        """None when target `tid` started (it is handed to the pool); else why it did not. A start
        still loading gives "loading" unless `decide_now` or START_TIMEOUT_S has passed."""
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        pending = self.starting.get(tid)
        if pending is None:
            return None
        done, _ = ray.wait([pending.ping], timeout=0)
        if not done and not decide_now and self.clock() - pending.since < START_TIMEOUT_S:
            return "loading"
        del self.starting[tid]
        try:
            ray.get(pending.ping, timeout=None if done else 0)
        except (RayError, GetTimeoutError) as exc:
            ray.kill(pending.handle, no_restart=True)
            return last_line(exc) if done else f"no answer within {START_TIMEOUT_S:g} s"
        self.live[tid] = pending.handle
        self.pool.add_target(tid, pending.handle)
        return None
