"""Jobs on their way to the buffer: issued to a target within the capacity budget, landed in their
bucket, or failed back to the FRONT of the queue (the hidden states are recomputed, never kept). A job
whose forward keeps raising is quarantined instead of failing on every target for the rest of the run.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.messages import ItemMeta, JobSpec
from app.pool.budget import Budget
from app.pool.buffer import BucketBuffer, Item
from app.pool.inflight import InFlight
from app.pool.queue import JobQueue
from app.pool.states import JobState, JobStates
from app.pool.telemetry import PoolTelemetry

QUARANTINE_AFTER = 2  # forward failures of one job, on any targets, before it is quarantined


class Production:
    """The targets' side of the pool: which job a target gets next and what becomes of it. Shares the
    queue, job states, buffer, budget and telemetry with `HSPool`; calls `changed` after each change."""

    def __init__(self, jobs_per_target: int, queue: JobQueue, states: JobStates, buffer: BucketBuffer,
                 budget: Budget, tel: PoolTelemetry, clock: Callable[[], float],
                 changed: Callable[[], None]) -> None:
        self.jobs_per_target = jobs_per_target
        self.in_flight = InFlight()
        self.quarantined: dict[int, str] = {}  # job id -> error of its last failure
        self._failures: dict[int, int] = {}  # job id -> forward failures (any target)
        self._queue, self._states, self._buffer, self._budget = queue, states, buffer, budget
        self._tel, self._clock, self._changed = tel, clock, changed

    @property
    def items_held(self) -> int:
        """Items that count against pool.capacity: buffered + in flight."""
        return len(self._buffer) + len(self.in_flight)

    def next_job(self, target_id: int) -> JobSpec | None:
        job = self._queue.peek()
        if job is None or self.in_flight.count(target_id) >= self.jobs_per_target:
            return None
        reserve = self._budget.reservation(job)
        if not self._budget.fits(self.items_held, reserve):
            return None
        self._queue.pop()
        self.in_flight.start(job, target_id, self._clock(), reserve)
        self._budget.reserve(reserve)
        self._states.move(job.job_id, JobState.IN_FLIGHT)
        self._changed()
        return job

    def land(self, target_id: int, meta: ItemMeta, payload: Any) -> bool:
        """Buffer the item; False for a stale result (not in flight on this target)."""
        fl = self.in_flight.get(meta.job_id)
        if fl is None or fl.target_id != target_id:
            self._tel.stale_results += 1
            return False
        assert meta.bucket == fl.job.bucket, f"job {meta.job_id}: bucket {meta.bucket} != {fl.job.bucket}"
        self.in_flight.pop(meta.job_id)
        self._budget.land(fl.reserved_bytes, meta.nbytes, meta.bucket)
        self._buffer.put(Item(fl.job, meta, payload))
        self._states.move(meta.job_id, JobState.BUFFERED)
        self._tel.landed(target_id, meta)
        return True

    def failed(self, target_id: int, job_id: int) -> bool:
        if not self._runs_on(target_id, job_id):
            return False
        self._requeue([job_id])
        return True

    def raised(self, target_id: int, job_id: int, error: str) -> bool:
        """Back to the queue, or quarantined the QUARANTINE_AFTER-th time (see HSPool.job_raised)."""
        if not self._runs_on(target_id, job_id):
            return False
        self._failures[job_id] = self._failures.get(job_id, 0) + 1
        if self._failures[job_id] < QUARANTINE_AFTER:
            self._requeue([job_id])
            return True
        self._budget.unreserve(self.in_flight.pop(job_id).reserved_bytes)
        self._states.move(job_id, JobState.QUARANTINED)
        self.quarantined[job_id] = error
        self._changed()
        return True

    def target_lost(self, target_id: int) -> list[int]:
        ids = self.in_flight.of_target(target_id)
        self._requeue(ids)
        return ids

    def stalled(self) -> bool:
        """Nothing in flight and the next job does not fit: waiting for min_ready would deadlock
        (leases hold the bytes, and they are acked only after pulls succeed), so pulls drain."""
        job = self._queue.peek()
        if self.in_flight or job is None:
            return False
        return not self._budget.fits(self.items_held, self._budget.reservation(job))

    def _runs_on(self, target_id: int, job_id: int) -> bool:
        fl = self.in_flight.get(job_id)
        return fl is not None and fl.target_id == target_id

    def _requeue(self, job_ids: list[int]) -> None:
        """In-flight jobs back to the front of the queue, oldest first; reservations given back."""
        fls = sorted((self.in_flight.pop(j) for j in job_ids), key=lambda fl: fl.start)
        for fl in fls:
            self._budget.unreserve(fl.reserved_bytes)
            self._states.move(fl.job.job_id, JobState.PENDING)
        self._queue.push_front(fl.job.job_id for fl in fls)
        self._changed()
