"""Job states made explicit: every job the pool knows is in exactly one of them.

    PENDING ──issue──► IN_FLIGHT ──lands──► BUFFERED ──pull──► LEASED ──ack──► ACKED
       ▲                   │ target failed/lost                  │ released / payload lost
       └───────────────────┴─────────────────────────────────────┘
    IN_FLIGHT ──forward failed the second time──► QUARANTINED   (final: never trained, never acked)
    ACKED ──rollback──► PENDING      (re)stored ledger: unknown/PENDING ──► ACKED
"""
from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    PENDING = "pending"  # in the job queue
    IN_FLIGHT = "in_flight"  # on a target
    BUFFERED = "buffered"  # produced, in a bucket
    LEASED = "leased"  # pulled by a drafter, not acked
    ACKED = "acked"  # in the ledger
    QUARANTINED = "quarantined"  # a poison job: its forward failed twice; set aside for good


_LEGAL: dict[JobState | None, frozenset[JobState]] = {
    None: frozenset({JobState.PENDING, JobState.ACKED}),
    JobState.PENDING: frozenset({JobState.IN_FLIGHT, JobState.ACKED}),
    JobState.IN_FLIGHT: frozenset({JobState.BUFFERED, JobState.PENDING, JobState.QUARANTINED}),
    JobState.BUFFERED: frozenset({JobState.LEASED}),
    JobState.LEASED: frozenset({JobState.ACKED, JobState.PENDING}),
    JobState.ACKED: frozenset({JobState.PENDING}),
    JobState.QUARANTINED: frozenset(),
}


class JobStates:
    """The state of every known job id, with per-state counts kept in step (O(1) stats)."""

    def __init__(self) -> None:
        self._state: dict[int, JobState] = {}
        self._count = dict.fromkeys(JobState, 0)

    def move(self, job_id: int, to: JobState) -> None:
        """Record a transition; an illegal one is a bug in the pool, not a user error."""
        frm = self._state.get(job_id)
        assert to in _LEGAL[frm], f"job {job_id}: illegal transition {frm} -> {to}"
        if frm is not None:
            self._count[frm] -= 1
        self._state[job_id] = to
        self._count[to] += 1

    def get(self, job_id: int) -> JobState | None:
        return self._state.get(job_id)

    def count(self, state: JobState) -> int:
        return self._count[state]

    def counts(self) -> dict[str, int]:
        """{state name: jobs}, in life-cycle order."""
        return {s.value: self._count[s] for s in JobState}

    def __contains__(self, job_id: int) -> bool:
        return job_id in self._state

    def __len__(self) -> int:
        return len(self._state)
