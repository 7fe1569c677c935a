"""What supervision sees and does, as typed messages: the events the shell observed, the actions the
policy returns, the run-ending error and its one-line text. No Ray and no decisions here."""
from __future__ import annotations

from dataclasses import dataclass

from app.messages import DrafterPhase


class RunFailed(RuntimeError):
    """The run cannot go on; the message is one line naming the actor, the error and the setting."""


def last_line(exc: BaseException) -> str:
    """The last non-empty line of an error: for a Ray task error that is the remote exception itself,
    below the traceback Ray prepends."""
    lines = [l for l in str(exc).splitlines() if l.strip()]
    return lines[-1][:300] if lines else type(exc).__name__


# ---- events (what the shell observed) ----------------------------------------------------------

@dataclass(frozen=True)
class TargetFailed:
    """A running target died (the pool already re-queued its jobs)."""

    target_id: int
    reason: str


@dataclass(frozen=True)
class TargetStarted:
    """A (re)started target answered its first ping."""

    target_id: int


@dataclass(frozen=True)
class TargetStartFailed:
    """A (re)started target's `__init__` failed or did not finish in time (dead GPU, node gone)."""

    target_id: int
    reason: str


@dataclass(frozen=True)
class DrafterGroupFailed:
    """A drafter rank raised or died; the group cannot go on as is."""

    reason: str


@dataclass(frozen=True)
class DrafterGroupStarted:
    """A (re)built group finished setup at `step`: progress counts from now."""

    step: int


@dataclass(frozen=True)
class PoolFailed:
    """The pool actor died or stopped answering; `message` is its one line (where a resubmission resumes)."""

    message: str


@dataclass(frozen=True)
class StopSignal:
    """SIGTERM/SIGINT reached the driver."""


@dataclass(frozen=True)
class RankProgress:
    """What one drafter rank is doing: `phase` (see app.messages.DrafterPhase) for `age_s` seconds; `step`
    it is at. `phase` is DrafterPhase.UNRESPONSIVE when the rank did not answer the last progress query."""

    rank: int
    phase: str
    age_s: float
    step: int = 0


@dataclass(frozen=True)
class Tick:
    """A periodic look at the pool and the drafters."""

    oldest_in_flight_age_s: dict[int, float]  # target -> age of its oldest job
    servable: bool                             # a pull could be served now
    steps: int                                 # the group's highest global step seen
    ranks: tuple[RankProgress, ...] = ()
    quarantined: int = 0                       # jobs the pool quarantined so far
    total_jobs: int = 0                        # jobs of the run


# ---- actions (what the shell must do) ----------------------------------------------------------

@dataclass(frozen=True)
class RestartTarget:
    """Kill what is left of the target and start a new one in its bundle."""

    target_id: int
    attempt: int
    budget: int
    reason: str


@dataclass(frozen=True)
class GiveUpTarget:
    """The target's budget is spent: kill it and go on without it."""

    target_id: int
    restarts: int
    budget: int
    alive: int
    reason: str


@dataclass(frozen=True)
class KillStalledTarget:
    """The watchdog's verdict on a target: kill it; its failure comes back as TargetFailed."""

    target_id: int
    age_s: float


@dataclass(frozen=True)
class RebuildDrafters:
    """Tear the group down, roll the pool back to the latest checkpoint, build a new group."""

    reason: str
    attempt: int
    budget: int
    kind: str = "drafter_group"  # the restarts_total{kind} it counts as: "pool" when a recreated pool forces it


@dataclass(frozen=True)
class RecreatePool:
    """Start a new pool from the latest checkpoint, hand it the live targets, rebuild the drafter group."""

    reason: str
    attempt: int
    budget: int


@dataclass(frozen=True)
class RequestStop:
    """Ask the drafters to checkpoint at the next step boundary and return."""

    timeout_s: float


@dataclass(frozen=True)
class Fail:
    """The run cannot go on; `message` is the one line the user sees."""

    message: str


Action = RestartTarget | GiveUpTarget | KillStalledTarget | RebuildDrafters | RecreatePool | RequestStop | Fail
Event = (TargetFailed | TargetStarted | TargetStartFailed | DrafterGroupFailed | DrafterGroupStarted
         | PoolFailed | StopSignal | Tick)
