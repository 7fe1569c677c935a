"""Job states made explicit: every job the pool knows is in exactly one of them.

    PENDING ──issue──► IN_FLIGHT ──lands──► BUFFERED ──pull──► LEASED ──ack──► ACKED
       ▲                   │ target failed/lost                  │ released / payload lost
       └───────────────────┴─────────────────────────────────────┘
    IN_FLIGHT ──forward failed the second time──► QUARANTINED   (final: never trained, never acked)
    ACKED ──rollback──► PENDING      (re)stored ledger: unknown/PENDING ──► ACKED
    PENDING (in flight: dropped first) / BUFFERED ──rollback to a ledger holding the job──► ACKED
"""
from __future__ import annotations

from enum import Enum

import numpy as np

from app.messages import split_job_id


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
    JobState.BUFFERED: frozenset({JobState.LEASED, JobState.ACKED}),
    JobState.LEASED: frozenset({JobState.ACKED, JobState.PENDING}),
    JobState.ACKED: frozenset({JobState.PENDING}),
    JobState.QUARANTINED: frozenset(),
}


_STATES = (None, *JobState)  # code k of a state byte; 0 = unknown
_CODE = {state: k for k, state in enumerate(_STATES)}


class JobStates:
    """The state of every known job id, with per-state counts kept in step (O(1) stats).

    One byte per job: per epoch, a bytearray indexed by the job's index (`split_job_id`), grown as ids
    arrive or sized at once by `add_epoch`; a dict of ids would cost ~100 bytes per queued job."""

    def __init__(self) -> None:
        self._codes: dict[int, bytearray] = {}  # epoch -> state code per job index
        self._count = dict.fromkeys(JobState, 0)

    def move(self, job_id: int, to: JobState) -> None:
        """Record a transition; an illegal one is a bug in the pool, not a user error."""
        epoch, index = split_job_id(job_id)
        codes = self._codes.setdefault(epoch, bytearray())
        if index >= len(codes):
            codes.extend(bytes(max(index + 1 - len(codes), len(codes) // 2)))  # grow geometrically
        frm = _STATES[codes[index]]
        assert to in _LEGAL[frm], f"job {job_id}: illegal transition {frm} -> {to}"
        if frm is not None:
            self._count[frm] -= 1
        codes[index] = _CODE[to]
        self._count[to] += 1

    def add_epoch(self, epoch: int, pending: np.ndarray) -> None:
        """Jobs `flatnonzero(pending)` of `epoch` become PENDING at once (a whole epoch's schedule).
        Each must be unknown so far; the caller checks that (`known`) to name the fix."""
        codes = self._codes.setdefault(epoch, bytearray())
        if len(codes) < len(pending):
            codes.extend(bytes(len(pending) - len(codes)))
        view = np.frombuffer(codes, dtype=np.uint8, count=len(pending))  # writes through to `codes`
        assert not view[pending].any(), f"epoch {epoch}: a job added twice"
        view[pending] = _CODE[JobState.PENDING]
        self._count[JobState.PENDING] += int(np.count_nonzero(pending))

    def known(self, epoch: int, n: int) -> np.ndarray:
        """bool [n]: whether job index k of `epoch` has a state (a copy)."""
        codes = self._codes.get(epoch, bytearray())
        out = np.zeros(n, dtype=bool)
        m = min(n, len(codes))
        out[:m] = np.frombuffer(codes, dtype=np.uint8, count=m) != 0
        return out

    def get(self, job_id: int) -> JobState | None:
        epoch, index = split_job_id(job_id)
        codes = self._codes.get(epoch)
        return _STATES[codes[index]] if codes is not None and index < len(codes) else None

    def count(self, state: JobState) -> int:
        return self._count[state]

    def counts(self) -> dict[str, int]:
        """{state name: jobs}, in life-cycle order."""
        return {s.value: self._count[s] for s in JobState}

    def __contains__(self, job_id: int) -> bool:
        return self.get(job_id) is not None

    def __len__(self) -> int:
        return sum(self._count.values())
