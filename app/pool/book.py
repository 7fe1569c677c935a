"""The job queue shared by all targets: pending jobs, in schedule order, re-queued ones in front.

Compact: an epoch's jobs wait as a cursor over its schedule (the next index, and a bitmap of indices
to skip: acked in a restored ledger), re-queued jobs as ids; a JobSpec is made from the catalog only
for the job at the head (`peek`, `pop`). So the queue costs an eighth of a byte per queued job of an
added epoch instead of a JobSpec (~1.4 KB with its sequence tuple). Jobs added one by one (tests,
benches) wait as ids in the same order.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

from app.data.schedule import EpochJobs
from app.messages import JobSpec, make_job_id, split_job_id
from app.pool.records import JobCatalog, bit, pack_bits


class _EpochCursor:
    """One epoch's pending jobs in schedule order: indices next..n-1 whose skip bit is clear."""

    __slots__ = ("epoch", "n", "next", "skip", "left")

    def __init__(self, epoch: int, skipped: np.ndarray) -> None:
        self.epoch = epoch
        self.n = len(skipped)
        self.next = 0
        self.skip = pack_bits(skipped)  # its own copy: `remove` sets bits the catalog must not see
        self.left = self.n - int(np.count_nonzero(skipped))

    def first(self) -> int | None:
        """The next index to issue (skipped ones passed over for good), or None when none is left."""
        while self.next < self.n:
            if self.next & 7 == 0 and self.skip[self.next >> 3] == 0xFF:
                self.next += 8  # a whole byte of restored jobs (a resume skips many)
            elif bit(self.skip, self.next):
                self.next += 1
            else:
                return self.next
        return None

    def drop(self, index: int) -> bool:
        """Skip job `index` if it is still ahead; True when that removed a queued job."""
        if not self.next <= index < self.n or bit(self.skip, index):
            return False
        self.skip[index >> 3] |= 1 << (index & 7)
        self.left -= 1
        return True


class JobQueue:
    """FIFO of pending jobs. Jobs that come back (a failed target, a released lease, a rollback)
    go to the FRONT, in the order given, so they are recomputed first. The catalog it makes JobSpecs
    from is filled by its appends."""

    def __init__(self, catalog: JobCatalog | None = None) -> None:
        self.catalog = catalog if catalog is not None else JobCatalog()
        self._front: deque[int] = deque()  # re-queued job ids
        self._parts: deque[_EpochCursor | deque[int]] = deque()  # in add order; deque: ids added one by one
        self._len = 0
        self._head: JobSpec | None = None  # the JobSpec `peek` made, reused while it is still the head

    def append(self, job: JobSpec) -> None:
        self.catalog.add_spec(job)
        if not self._parts or not isinstance(self._parts[-1], deque):
            self._parts.append(deque())
        self._parts[-1].append(job.job_id)
        self._len += 1

    def append_epoch(self, jobs: EpochJobs, bytes_per_token: int, skipped: np.ndarray) -> None:
        """Every job of the epoch in schedule order, but those marked in `skipped` (bool per job)."""
        self.catalog.add_epoch(jobs, bytes_per_token, skipped)
        cursor = _EpochCursor(jobs.epoch, skipped)
        if cursor.left:
            self._parts.append(cursor)
            self._len += cursor.left

    def push_front(self, job_ids: Iterable[int]) -> None:
        """Put jobs back at the front; the first of `job_ids` becomes the next one issued."""
        ids = list(job_ids)
        self._front.extendleft(reversed(ids))
        self._len += len(ids)

    def peek(self) -> JobSpec | None:
        job_id = self._head_id()
        if job_id is None:
            return None
        if self._head is None or self._head.job_id != job_id:
            self._head = self.catalog.spec(job_id)
        return self._head

    def pop(self) -> JobSpec:
        job = self.peek()
        if job is None:
            raise IndexError("pop from an empty JobQueue")
        if self._front:
            self._front.popleft()
        else:
            part = self._parts[0]  # _head_id left the head part first
            if isinstance(part, deque):
                part.popleft()
            else:
                part.next += 1
                part.left -= 1
        self._len -= 1
        self._head = None
        return job

    def remove(self, job_ids: set[int]) -> None:
        """Drop these ids (a restored ledger: they are never issued again)."""
        front = deque(j for j in self._front if j not in job_ids)
        removed = len(self._front) - len(front)
        self._front = front
        cursors = {}
        for i, part in enumerate(list(self._parts)):
            if isinstance(part, deque):
                kept = deque(j for j in part if j not in job_ids)
                removed += len(part) - len(kept)
                self._parts[i] = kept
            else:
                cursors[part.epoch] = part
        if cursors:
            for job_id in job_ids:
                epoch, index = split_job_id(job_id)
                cursor = cursors.get(epoch)
                if cursor is not None and cursor.drop(index):
                    removed += 1
        self._len -= removed

    def __len__(self) -> int:
        return self._len

    def _head_id(self) -> int | None:
        """The id of the next job, dropping spent parts from the head."""
        if self._front:
            return self._front[0]
        while self._parts:
            part = self._parts[0]
            if isinstance(part, deque):
                if part:
                    return part[0]
            else:
                index = part.first()
                if index is not None:
                    return make_job_id(part.epoch, index)
            self._parts.popleft()
        return None
