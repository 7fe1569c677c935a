"""Jobs on their way to the buffer: issued to a target within the capacity budget, landed in their
bucket, or failed back to the FRONT of the queue (the hidden states are recomputed, never kept).

A job whose forward raised waits among the re-tries (issued before the queue, to a target that did
not fail it yet); one that raised on two targets is quarantined, and a target that raises on every
job is broken instead, without charging its jobs (the rules: `strikes.py`). `InFlight` records which
target runs each job, since when, and the bytes reserved for its payload.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.messages import ItemMeta, JobSpec
from app.pool.book import JobQueue
from app.pool.holdings import BucketBuffer, Budget, Item
from app.pool.records import JobState, JobStates
from app.pool.strikes import Strikes, Verdict
from app.pool.telemetry import PoolTelemetry


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


class Production:
    """The targets' side of the pool: which job a target gets next and what becomes of it. Shares the
    queue, job states, buffer, budget and telemetry with `HSPool`; calls `changed` after each change."""

    def __init__(self, jobs_per_target: int, queue: JobQueue, states: JobStates, buffer: BucketBuffer,
                 budget: Budget, tel: PoolTelemetry, clock: Callable[[], float],
                 changed: Callable[[], None], broken_after: int = 3) -> None:
        """`broken_after`: raises in a row that make a target broken (supervision.broken_target_raises)."""
        # Several drafter runs on one stream (`stream.py`): the stream's own budget, counting a shared
        # ref once, must also admit a job; None for a pool of its own.
        self.gate: Callable[[int], bool] | None = None
        self.jobs_per_target = jobs_per_target
        self.in_flight = InFlight()
        self.quarantined: dict[int, str] = {}  # job id -> error of its last failure
        self.strikes = Strikes(broken_after)
        self.retries: list[int] = []  # pending jobs whose forward raised, oldest first; issued before the queue
        self._queue, self._states, self._buffer, self._budget = queue, states, buffer, budget
        self._tel, self._clock, self._changed = tel, clock, changed

    @property
    def items_held(self) -> int:
        """Items that count against pool.capacity: buffered + in flight."""
        return len(self._buffer) + len(self.in_flight)

    @property
    def waiting(self) -> int:
        """Jobs waiting for a target: queued and re-tries."""
        return len(self._queue) + len(self.retries)

    def next_job(self, target_id: int) -> JobSpec | None:
        if target_id in self.strikes.broken or self.in_flight.count(target_id) >= self.jobs_per_target:
            return None
        self.strikes.saw(target_id)
        job = self._choose(target_id)
        if job is None:
            return None
        if not self.fits(job):
            return None
        if job.job_id in self.retries:
            self.retries.remove(job.job_id)
        else:
            self._queue.pop()
        self._start(job, target_id)
        return job

    def candidate(self, target_id: int) -> JobSpec | None:
        """The job `next_job` would consider for this target, issuing nothing and checking no budget."""
        if target_id in self.strikes.broken or self.in_flight.count(target_id) >= self.jobs_per_target:
            return None
        return self._choose(target_id)

    def reservation(self, job: JobSpec) -> int:
        return self._budget.reservation(job)

    def fits(self, job: JobSpec) -> bool:
        """Whether the budget (and the stream's gate, if any) admits this job now."""
        reserve = self._budget.reservation(job)
        return self._budget.fits(self.items_held, reserve) and (self.gate is None or self.gate(reserve))

    def issue(self, job: JobSpec, target_id: int) -> None:
        """Put this pending job (the head, a re-try, or any queued one: another run of the stream chose
        it) in flight on the target; the caller checked `fits`."""
        assert self._states.get(job.job_id) is JobState.PENDING, f"job {job.job_id} is not pending"
        if job.job_id in self.retries:
            self.retries.remove(job.job_id)
        else:
            self._queue.remove({job.job_id})
        self.strikes.saw(target_id)
        self._start(job, target_id)

    def _start(self, job: JobSpec, target_id: int) -> None:
        reserve = self._budget.reservation(job)
        self.in_flight.start(job, target_id, self._clock(), reserve)
        self._budget.reserve(reserve)
        self._states.move(job.job_id, JobState.IN_FLIGHT)
        self._changed()

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
        self.strikes.landed(target_id, meta.job_id)
        self._tel.landed(target_id, meta)
        return True

    def failed(self, target_id: int, job_id: int) -> bool:
        if not self._runs_on(target_id, job_id):
            return False
        self._requeue([job_id])
        return True

    def raised(self, target_id: int, job_id: int, error: str) -> bool:
        """The job's forward raised on a live target: re-tried first on another target, or, once it
        raised on two different targets, quarantined: a poison job (a token id beyond the vocabulary,
        an OOM on the one largest job) would otherwise fail on every target for the rest of the run.
        A quarantined job is never trained nor acked; `quarantined` maps its id to the last error. A
        target that raises `broken_after` times in a row is broken instead (a poisoned CUDA context):
        it gets no more jobs and its jobs are not charged (rules: `strikes.py`). A target dying is not
        counted here (`failed`): the job that happened to be in flight is not to blame."""
        if not self._runs_on(target_id, job_id):
            return False
        if self.strikes.raised(target_id, job_id) is not Verdict.QUARANTINE:
            self._requeue([job_id])
            return True
        self.strikes.forget(job_id)
        self._budget.unreserve(self.in_flight.pop(job_id).reserved_bytes)
        self._states.move(job_id, JobState.QUARANTINED)
        self.quarantined[job_id] = error
        self._changed()
        return True

    def target_lost(self, target_id: int) -> list[int]:
        ids = self.in_flight.of_target(target_id)
        self._requeue(ids)
        self.strikes.lost(target_id)
        return ids

    def target_added(self, target_id: int) -> None:
        """A new incarnation of the target: its raise streak and broken mark are gone; it is alive."""
        self.strikes.reset(target_id)
        self.strikes.saw(target_id)

    def take_back(self, job_id: int) -> bool:
        """Drop a re-try or an in-flight job (a rollback acks it; queued ones are the queue's to drop):
        True if it was here. A result its target still sends is then stale and dropped."""
        if job_id in self.retries:
            self.retries.remove(job_id)
        elif self.in_flight.get(job_id) is not None:
            self._budget.unreserve(self.in_flight.pop(job_id).reserved_bytes)
            self._states.move(job_id, JobState.PENDING)
        else:
            return False
        self.strikes.forget(job_id)
        return True

    def stalled(self) -> bool:
        """Nothing in flight and the next job does not fit: waiting for min_ready would deadlock
        (leases hold the bytes, and they are acked only after pulls succeed), so pulls drain."""
        job = self._queue.peek() or (self._queue.catalog.spec(self.retries[0]) if self.retries else None)
        if self.in_flight or job is None:
            return False
        reserve = self._budget.reservation(job)
        if not self._budget.fits(self.items_held, reserve):
            return True
        # Blocked only by the stream's shared budget: drain only while this run's own leases are part of
        # what holds it (it acks them after the step); with none, it waits for the other runs instead of
        # stepping on nothing.
        return self.gate is not None and self._budget.leased > 0 and not self.gate(reserve)

    def _choose(self, target_id: int) -> JobSpec | None:
        """A re-try this target did not fail yet, else the queue's head, else a re-try it failed that
        no other healthy target could take (a lone target)."""
        spec = self._queue.catalog.spec
        for job_id in self.retries:
            if self.strikes.may_take(job_id, target_id):
                return spec(job_id)
        head = self._queue.peek()
        if head is not None:
            return head
        return next((spec(j) for j in self.retries if self.strikes.last_resort(j, target_id)), None)

    def _runs_on(self, target_id: int, job_id: int) -> bool:
        fl = self.in_flight.get(job_id)
        return fl is not None and fl.target_id == target_id

    def _requeue(self, job_ids: list[int]) -> None:
        """In-flight jobs back to the front of the queue, oldest first (those with strikes to the re-tries);
        reservations given back."""
        fls = sorted((self.in_flight.pop(j) for j in job_ids), key=lambda fl: fl.start)
        for fl in fls:
            self._budget.unreserve(fl.reserved_bytes)
            self._states.move(fl.job.job_id, JobState.PENDING)
        ids = [fl.job.job_id for fl in fls]
        self.retries += [j for j in ids if self.strikes.charged(j)]
        self._queue.push_front(j for j in ids if not self.strikes.charged(j))
        self._changed()
