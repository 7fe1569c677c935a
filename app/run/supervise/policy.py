"""Supervision as a pure policy: events and a clock in, typed actions out (no Ray here).

Two halves, as the stream and its runs split the actors (app/run/supervisor.py): `TargetPolicy` decides for
what the runs of a stream share (the targets, the pool), `DrafterPolicy` for one run's drafter group. The
shells turn what they see (pool snapshots, finished or crashed actors, drafter progress) into the events of
`events.py`, hand each to its half and carry out the returned actions with Ray. Every rule is therefore
testable without a cluster (`tests/test_supervision.py`).

Rules of the targets' half:
- A target that failed (crash, watchdog kill, or a replacement whose start failed) is restarted
  while its budget `max_restarts_target` lasts; a spent budget gives it up and the run goes on
  without it; 0 fails fast. Restarts are asynchronous: while one loads, the policy keeps deciding.
- No target alive and none starting: the run fails.
- Watchdog: a target holding a job longer than `stall_timeout_s` is killed (once; the pool then
  reports its failure).
- A pool that died (or stopped answering) is recreated while `max_restarts_pool` lasts: the shell
  restores the new pool from each run's latest checkpoint, re-registers the live targets and rebuilds
  every run's drafter group; a spent budget fails the run with the pool's one line.
- Quarantine: more than `max_quarantined_share` of the run's jobs quarantined (and more than one)
  fails the run: so many poison jobs mean broken data or targets, not a few bad records.

Rules of a run's drafters' half:
- A drafter crash or stall rebuilds the whole group while `max_restarts_drafter_group` lasts.
- Watchdog: the drafter group is stalled when it made no step for `stall_timeout_s` and it is not
  simply starving: starving means some rank waits for a pull and the pool has nothing to serve. A rank
  stuck outside a collective (computing, or not answering at all) while nothing is buffered - the last
  step, a byte-full pool - is therefore a stall too.
- Stop: the first stop signal asks the drafters to checkpoint; past `stop_timeout_s` the run fails.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from app.config.run_sections import SupervisionConfig
from app.messages import DrafterPhase
from app.run.supervise.events import (Action, DrafterGroupFailed, DrafterGroupStarted, Event, Fail, GiveUpTarget,
                                      KillStalledTarget, PoolFailed, RebuildDrafters, RecreatePool, RequestStop,
                                      RestartTarget, StopSignal, TargetFailed, TargetStarted, TargetStartFailed, Tick)


class TargetState(str, Enum):
    """A target slot's life cycle as the policy sees it."""

    STARTING = "starting"
    ALIVE = "alive"
    KILLED = "killed"      # the watchdog killed it; waiting for the pool to report the failure
    GIVEN_UP = "given_up"


@dataclass
class _Target:
    state: TargetState
    restarts: int = 0


@dataclass
class TargetPolicy:
    """The stream's half: its targets' restarts and give-ups, the target watchdog, the quarantine share and the
    pool's recreations. `on(event, now)` returns the actions to carry out, in order."""

    cfg: SupervisionConfig
    num_targets: int
    now: float = 0.0
    targets: dict[int, _Target] = field(default_factory=dict)
    pool_restarts: int = 0
    failures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.targets = {i: _Target(TargetState.STARTING) for i in range(self.num_targets)}

    # ---- queries -----------------------------------------------------------------------------

    def alive(self) -> list[int]:
        return [t for t, s in self.targets.items() if s.state is TargetState.ALIVE]

    def add_target(self, tid: int) -> None:
        """A re-split gave the targets a new slot: it is starting, with a fresh restart budget."""
        self.targets[tid] = _Target(TargetState.STARTING)

    def retire_target(self, tid: int) -> None:
        """A re-split gave this target's bundle to the drafters: never restarted, late reports ignored."""
        self.targets[tid].state = TargetState.GIVEN_UP

    def restarts(self) -> dict[str, int]:
        return {"target": sum(s.restarts for s in self.targets.values()), "pool": self.pool_restarts}

    # ---- events ------------------------------------------------------------------------------

    def on(self, event: Event, now: float) -> list[Action]:
        self.now = now
        if isinstance(event, TargetStarted):
            self.targets[event.target_id].state = TargetState.ALIVE
            return []
        if isinstance(event, (TargetFailed, TargetStartFailed)):
            return self._target_failed(event.target_id, event.reason)
        if isinstance(event, PoolFailed):
            return self._recreate_pool(event.message)
        if isinstance(event, Tick):
            return self._tick(event)
        raise TypeError(f"not a target supervision event {event!r}")

    def _target_failed(self, tid: int, reason: str) -> list[Action]:
        slot = self.targets[tid]
        if slot.state is TargetState.GIVEN_UP:
            return []  # a late report about a target already let go
        self.failures.append(f"target {tid}: {reason}")
        budget = self.cfg.max_restarts_target
        if budget == 0:
            return [Fail(f"TargetActor {tid} failed ({reason}) and supervision.max_restarts_target=0; "
                         "raise supervision.max_restarts_target to restart crashed targets")]
        if slot.restarts >= budget:
            slot.state = TargetState.GIVEN_UP
            actions: list[Action] = [GiveUpTarget(tid, slot.restarts, budget, len(self.alive()), reason)]
            return actions + self._check_any_target()
        slot.restarts += 1
        slot.state = TargetState.STARTING
        return [RestartTarget(tid, slot.restarts, budget, reason)]

    def _check_any_target(self) -> list[Action]:
        if any(s.state is not TargetState.GIVEN_UP for s in self.targets.values()):
            return []
        return [Fail(f"no target left: {'; '.join(self.failures[-3:])}; raise supervision.max_restarts_target "
                     f"(now {self.cfg.max_restarts_target})")]

    def _recreate_pool(self, message: str) -> list[Action]:
        budget = self.cfg.max_restarts_pool
        if self.pool_restarts >= budget:
            return [Fail(f"{message} (supervision.max_restarts_pool={budget} spent)")]
        self.pool_restarts += 1
        return [RecreatePool(message, self.pool_restarts, budget)]

    def _tick(self, tick: Tick) -> list[Action]:
        """The target watchdog and the quarantine share (the tick's target fields)."""
        actions: list[Action] = []
        for tid, age in sorted(tick.oldest_in_flight_age_s.items()):
            slot = self.targets.get(tid)
            if slot is not None and slot.state is TargetState.ALIVE and age > self.cfg.stall_timeout_s:
                slot.state = TargetState.KILLED
                actions.append(KillStalledTarget(tid, age))
        return actions + self._check_quarantined(tick)

    def _check_quarantined(self, tick: Tick) -> list[Action]:
        share = self.cfg.max_quarantined_share
        allowed = max(1, int(share * tick.total_jobs))  # one poison job never stops a small run
        if tick.quarantined <= allowed:
            return []
        return [Fail(f"{tick.quarantined} of {tick.total_jobs} jobs quarantined ({tick.quarantined / tick.total_jobs:.1%}"
                     f" > supervision.max_quarantined_share={share:g}): their forwards raise on every target "
                     "(quarantined_jobs in the log name each error); fix the data or the targets, or raise the share")]


@dataclass
class DrafterPolicy:
    """One run's half: its drafter group's rebuilds, the drafter stall watchdog and the stop deadline.
    `on(event, now)` returns the actions to carry out, in order."""

    cfg: SupervisionConfig
    now: float = 0.0
    group_rebuilds: int = 0
    last_progress: float = 0.0
    last_step: int = 0
    stop_deadline: float | None = None

    def __post_init__(self) -> None:
        self.last_progress = self.now

    def restarts(self) -> dict[str, int]:
        return {"drafter_group": self.group_rebuilds}

    def on(self, event: Event, now: float) -> list[Action]:
        self.now = now
        if isinstance(event, DrafterGroupFailed):
            return self._rebuild(event.reason)
        if isinstance(event, DrafterGroupStarted):
            self.last_progress, self.last_step = now, event.step
            return []
        if isinstance(event, StopSignal):
            if self.stop_deadline is not None:
                return []
            self.stop_deadline = now + self.cfg.stop_timeout_s
            return [RequestStop(self.cfg.stop_timeout_s)]
        if isinstance(event, Tick):
            return self._tick(event)
        raise TypeError(f"not a drafter supervision event {event!r}")

    def _rebuild(self, reason: str) -> list[Action]:
        budget = self.cfg.max_restarts_drafter_group
        if self.group_rebuilds >= budget:
            return [Fail(f"DrafterActor group failed ({reason}) and its restart budget is spent "
                         f"({self.group_rebuilds}/{budget}); raise supervision.max_restarts_drafter_group")]
        self.group_rebuilds += 1
        self.last_progress = self.now  # the new group gets a full stall timeout to show progress
        return [RebuildDrafters(reason, self.group_rebuilds, budget)]

    def _tick(self, tick: Tick) -> list[Action]:
        """The drafter stall watchdog and the stop deadline (the tick's drafter fields)."""
        actions: list[Action] = []
        timeout = self.cfg.stall_timeout_s
        if tick.steps > self.last_step:
            self.last_step, self.last_progress = tick.steps, self.now
        idle = self.now - self.last_progress
        if idle > timeout and self.drafters_stalled(tick):
            actions += self._rebuild(f"drafters made no step for {idle:.0f} s ({_describe(tick)}) (watchdog)")
        if self.stop_deadline is not None and self.now > self.stop_deadline:
            actions.append(Fail(f"drafters did not checkpoint within supervision.stop_timeout_s="
                                f"{self.cfg.stop_timeout_s:g}; the last periodic checkpoint stands; raise the "
                                "timeout if steps are slow"))
        return actions

    @staticmethod
    def drafters_stalled(tick: Tick) -> bool:
        """No step for long enough is a stall unless the group is starving: some rank waits for a
        pull while the pool has nothing it could serve (then the targets are the slow side, and the
        target watchdog covers a wedged target)."""
        if tick.servable:
            return True
        if not tick.ranks:
            return False  # no progress reports: only the servable rule can judge
        starving = any(r.phase == DrafterPhase.WAIT_DATA for r in tick.ranks)
        finished = all(r.phase == DrafterPhase.DONE for r in tick.ranks)
        return not starving and not finished


def _describe(tick: Tick) -> str:
    if tick.servable:
        return "with data waiting"
    stuck = [f"rank {r.rank} {r.phase} {r.age_s:.0f} s" for r in tick.ranks if r.phase != DrafterPhase.COLLECTIVE]
    return "; ".join(stuck) or "every rank in a collective"
