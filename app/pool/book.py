"""The pool's book (`JobBook`): every job it was given and where each one is; the one state its producing
side (`sides.py`) and its drafters' side (`drafters.py`) share, so each is handed the book, not a dozen
parts. Jobs enter as whole epochs (`add_epoch`, the run's path) or JobSpec lists (`add_jobs`, tests and
benches), checked, with the ids of a restored ledger skipped. The errors name the bad job and the fix:
jobs come from the driver's schedule, so they mean a caller built them wrong.

The job queue, shared by all targets: pending jobs, in schedule order, re-queued ones in front.
Compact: an epoch's jobs wait as a cursor over its schedule (the next index, and a bitmap of indices
to skip: acked in a restored ledger), re-queued jobs as ids; a JobSpec is made from the catalog only
for the job at the head (`peek`, `pop`). So the queue costs an eighth of a byte per queued job of an
added epoch instead of a JobSpec (~1.4 KB with its sequence tuple). Jobs added one by one (tests,
benches) wait as ids in the same order.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from app.data.schedule import EpochJobs
from app.messages import JobSpec, make_job_id, split_job_id
from app.pool.holdings import BucketBuffer, Budget, LeaseTable
from app.pool.records import JobCatalog, JobState, JobStates, Ledger, bit, pack_bits
from app.pool.telemetry import PoolTelemetry


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


@dataclass
class InFlightJob:
    """A job on a target: which target, since when, and the bytes reserved for its payload."""

    job: JobSpec
    target_id: int
    start: float
    reserved_bytes: int


class InFlight:
    """job id -> InFlightJob, with per-target counts for the job slots."""

    def __init__(self) -> None:
        self._jobs: dict[int, InFlightJob] = {}
        self._per_target: dict[int, int] = {}

    def start(self, job: JobSpec, target_id: int, now: float, reserved_bytes: int) -> None:
        assert job.job_id not in self._jobs, f"job {job.job_id} issued twice"
        self._jobs[job.job_id] = InFlightJob(job, target_id, now, reserved_bytes)
        self._per_target[target_id] = self._per_target.get(target_id, 0) + 1

    def get(self, job_id: int) -> InFlightJob | None:
        return self._jobs.get(job_id)

    def pop(self, job_id: int) -> InFlightJob:
        fl = self._jobs.pop(job_id)
        self._per_target[fl.target_id] -= 1
        return fl

    def of_target(self, target_id: int) -> list[int]:
        return [jid for jid, fl in self._jobs.items() if fl.target_id == target_id]

    def count(self, target_id: int) -> int:
        return self._per_target.get(target_id, 0)

    def by_target(self) -> dict[int, list[tuple[int, float]]]:
        """target -> [(job id, start)], for stats and the watchdog."""
        out: dict[int, list[tuple[int, float]]] = {}
        for jid, fl in self._jobs.items():
            out.setdefault(fl.target_id, []).append((jid, fl.start))
        return out

    def __len__(self) -> int:
        return len(self._jobs)


class JobBook:
    """Where every job is, kept in step by both sides of the pool: its state (`states`), its JobSpec
    (`catalog`), its place in the `queue`, `in_flight`, the `buffer` or the `leases`, its ack (`ledger`),
    and the byte `budget`; with the counters (`tel`), the clock and `changed`, which every side calls after
    a change (the pool wakes its waiters). Jobs enter here and are refused after `finished`: unique ids,
    a bucket the pool has, a payload that fits."""

    def __init__(self, num_buckets: int, capacity: int, capacity_bytes: int,
                 queue: Callable[[JobCatalog], JobQueue] = JobQueue, clock: Callable[[], float] = time.monotonic,
                 changed: Callable[[], None] = lambda: None) -> None:
        """`queue` builds the job queue over the catalog (a test passes a reference queue)."""
        self.num_buckets = num_buckets
        self.states = JobStates()
        self.catalog = JobCatalog()  # every job added, for re-queueing on rollback
        self.queue = queue(self.catalog)
        self.ledger = Ledger()
        self.in_flight = InFlight()
        self.buffer = BucketBuffer(num_buckets)
        self.leases = LeaseTable()
        self.budget = Budget(capacity, capacity_bytes, num_buckets)
        self.tel = PoolTelemetry(num_buckets)
        self.clock, self.changed = clock, changed
        self.finished = False  # no more jobs will be added

    def add_jobs(self, jobs: Iterable[JobSpec]) -> list[int]:
        """Queue these jobs but the acked ones; returns how many per bucket (so does `add_epoch`)."""
        self._refuse_after_finish("add_jobs")
        added = [0] * self.num_buckets
        for job in jobs:
            if job.job_id in self.ledger:
                continue
            self._check_job(job)
            self.states.move(job.job_id, JobState.PENDING)
            self.queue.append(job)
            added[job.bucket] += 1
        return added

    def add_epoch(self, jobs: EpochJobs, bytes_per_token: int) -> list[int]:
        self._refuse_after_finish("add_epoch")
        skipped = self.ledger.mask(jobs.epoch, len(jobs))
        queued = ~skipped
        self._check_epoch(jobs, bytes_per_token, queued)
        self.states.add_epoch(jobs.epoch, queued)
        self.queue.append_epoch(jobs, bytes_per_token, skipped)
        return np.bincount(jobs.bucket[queued], minlength=self.num_buckets).tolist()

    def restore(self, acked_ids: Iterable[int]) -> None:
        """Jobs acked by a previous run (from a checkpoint) join the ledger and leave the queue."""
        ids = set(acked_ids)
        for jid in ids:
            if jid not in self.ledger:
                self.states.move(jid, JobState.ACKED)
                self.ledger.add(jid)
        self.queue.remove(ids)

    def _refuse_after_finish(self, call: str) -> None:
        if self.finished:
            raise ValueError(f"{call} after finish_adding: add every job of the run first")

    def _check_job(self, job: JobSpec) -> None:
        if job.job_id in self.states:
            raise ValueError(_twice(job.job_id))
        if not 0 <= job.bucket < self.num_buckets:
            raise ValueError(self._bad_bucket(job.job_id, job.bucket))
        if job.est_bytes > self.budget.capacity_bytes:
            raise ValueError(self._too_big(job.job_id, job.est_bytes))

    def _check_epoch(self, jobs: EpochJobs, bytes_per_token: int, queued: np.ndarray) -> None:
        """`_check_job` for the queued jobs of a whole epoch, vectorised; the first bad job is named."""
        def first(bad: np.ndarray) -> int | None:
            hit = np.flatnonzero(queued & bad)
            return int(hit[0]) if hit.size else None

        if self.catalog.has_epoch(jobs.epoch):
            raise ValueError(_twice(make_job_id(jobs.epoch, 0)))
        if (k := first(self.states.known(jobs.epoch, len(jobs)))) is not None:
            raise ValueError(_twice(make_job_id(jobs.epoch, k)))
        if (k := first(jobs.bucket >= self.num_buckets)) is not None:
            raise ValueError(self._bad_bucket(make_job_id(jobs.epoch, k), int(jobs.bucket[k])))
        if (k := first(jobs.all_payload_bytes(bytes_per_token) > self.budget.capacity_bytes)) is not None:
            raise ValueError(self._too_big(make_job_id(jobs.epoch, k), jobs.payload_bytes(k, bytes_per_token)))

    def _bad_bucket(self, job_id: int, bucket: int) -> str:
        return (f"job {job_id} has bucket {bucket}, outside 0..{self.num_buckets - 1}: "
                "build the pool with num_buckets = len(data.bucket_boundaries)")

    def _too_big(self, job_id: int, est_bytes: int) -> str:
        return (f"job {job_id} needs ~{est_bytes} bytes, more than pool.capacity_bytes="
                f"{self.budget.capacity_bytes}: raise pool.capacity_bytes or lower data.tokens_per_job")


def _twice(job_id: int) -> str:
    return f"job {job_id} added twice: job ids must be unique across epochs"
