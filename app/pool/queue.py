"""The job queue shared by all targets: pending jobs, in schedule order, re-queued ones in front."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from app.messages import JobSpec


class JobQueue:
    """FIFO of pending jobs. Jobs that come back (a failed target, a released lease, a rollback)
    go to the FRONT, in the order given, so they are recomputed first."""

    def __init__(self) -> None:
        self._q: deque[JobSpec] = deque()

    def append(self, job: JobSpec) -> None:
        self._q.append(job)

    def push_front(self, jobs: Iterable[JobSpec]) -> None:
        """Put jobs back at the front; the first of `jobs` becomes the next one issued."""
        for job in reversed(list(jobs)):
            self._q.appendleft(job)

    def peek(self) -> JobSpec | None:
        return self._q[0] if self._q else None

    def pop(self) -> JobSpec:
        return self._q.popleft()

    def remove(self, job_ids: set[int]) -> None:
        """Drop these ids (a restored ledger: they are never issued again)."""
        self._q = deque(j for j in self._q if j.job_id not in job_ids)

    def __len__(self) -> int:
        return len(self._q)
