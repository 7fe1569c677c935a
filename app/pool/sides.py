"""Jobs on their way to the buffer: issued to a target within the capacity budget, landed in their
bucket, or failed back to the FRONT of the queue (the hidden states are recomputed, never kept).

Whose fault a raised forward is, the job's (a poison job) or the target's (a broken GPU): a target
whose CUDA context is poisoned (a sticky illegal memory access, a wedged driver) raises on every job
within milliseconds and frees its slot first, so it would take every re-tried job and quarantine the
dataset two strikes at a time. So `Strikes` are kept per (job, target):
- a target that raises `broken_after` times in a row (no job landed in between; distinct jobs
  whenever the pool had another to give it) is broken: it gets no more jobs, and the strikes it gave
  are taken back (its jobs are not charged). A new incarnation of it (`reset`) starts clean;
- a job is quarantined once it raised on two different targets, or, when no other target could
  take it, raised again on a target that has landed other jobs (a lone healthy target);
- a job that raised waits among the re-tries (issued before the queue) and is re-tried first on a
  target that did not fail it yet (`may_take`), and on one that did only as a last resort
  (`last_resort`: every other known healthy target failed it too).
"""
from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

from app.messages import ItemMeta, JobSpec
from app.pool.book import JobBook
from app.pool.holdings import Item
from app.pool.records import JobState


class Production:
    """The targets' side of the pool: which job a target gets next and what becomes of it, over the
    pool's book (queue, job states, buffer, budget, telemetry); calls the book's `changed` after each change."""

    def __init__(self, book: JobBook, jobs_per_target: int, broken_after: int = 3) -> None:
        """`broken_after`: raises in a row that make a target broken (supervision.broken_target_raises)."""
        # Several drafter runs on one stream (`stream.py`): the stream's own budget, counting a shared
        # ref once, must also admit a job; None for a pool of its own.
        self.gate: Callable[[int], bool] | None = None
        self.jobs_per_target = jobs_per_target
        self.in_flight = book.in_flight
        self.quarantined: dict[int, str] = {}  # job id -> error of its last failure
        self.strikes = Strikes(broken_after)
        self.retries: list[int] = []  # pending jobs whose forward raised, oldest first; issued before the queue
        self._book = book
        self._queue, self._states, self._buffer, self._budget = book.queue, book.states, book.buffer, book.budget
        self._tel, self._clock, self._changed = book.tel, book.clock, book.changed

    @property
    def finished(self) -> bool:
        """Every job is produced: nothing pending, nothing in flight, no more coming."""
        return self._book.finished and not self.waiting and not self.in_flight

    def buffer_changed(self) -> None:
        """The buffer's counts moved: the backlog meter integrates them while production goes on."""
        self._tel.backlog.update(self._clock(), self._buffer.counts(), active=not self.finished)

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
        self.strikes.saw(target_id)  # it asked for a job: alive (as in `next_job`)
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
        elif (head := self._queue.peek()) is not None and head.job_id == job.job_id:
            self._queue.pop()  # the head, in O(1) (always, in a stream of one run)
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
        self.buffer_changed()
        return True

    def failed(self, target_id: int, job_id: int) -> bool:
        if not self._runs_on(target_id, job_id):
            return False
        self._requeue([job_id])
        return True

    def raised(self, target_id: int, job_id: int, error: str) -> bool:
        """The job's forward raised on a live target: re-tried, quarantined (a poison job, e.g. a token id
        beyond the vocabulary: never trained nor acked; `quarantined` maps its id to the last error) or, on a
        broken target, not charged; the rules above. A target dying is `failed`: its job is not to blame."""
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


class Verdict(str, Enum):
    RETRY = "retry"  # the job goes back, to be re-tried on another target first
    QUARANTINE = "quarantine"  # a poison job: set aside for good
    BROKEN = "broken"  # the target is broken; the job is not charged
    UNCHARGED = "uncharged"  # a late raise from a target already found broken


class Strikes:
    """Forward failures per job and target, raise streaks per target, and the broken targets (the rules
    above)."""

    def __init__(self, broken_after: int) -> None:
        assert broken_after >= 2, broken_after  # 1 would call a target broken for one poison job
        self.broken_after = broken_after
        self.failed_on: dict[int, set[int]] = {}  # job id -> targets its forward raised on (charged)
        self.broken: set[int] = set()
        self._streak: dict[int, list[int]] = {}  # target -> job ids it raised on since its last landing
        self._landed: set[int] = set()  # targets that landed a job in this incarnation
        self._known: set[int] = set()  # targets that asked for jobs and were not lost since

    def saw(self, target_id: int) -> None:
        """The target asked for a job: it is alive."""
        self._known.add(target_id)

    def may_take(self, job_id: int, target_id: int) -> bool:
        return target_id not in self.failed_on.get(job_id, ())

    def last_resort(self, job_id: int, target_id: int) -> bool:
        """No other live, healthy target could re-try the job: this one (which failed it) may."""
        return self._known - self.broken - {target_id} <= self.failed_on.get(job_id, set())

    def landed(self, target_id: int, job_id: int) -> None:
        self._streak.pop(target_id, None)
        self._landed.add(target_id)
        self.failed_on.pop(job_id, None)

    def raised(self, target_id: int, job_id: int) -> Verdict:
        if target_id in self.broken:
            return Verdict.UNCHARGED
        streak = self._streak.setdefault(target_id, [])
        streak.append(job_id)
        if len(streak) >= self.broken_after:
            self._mark_broken(target_id)
            return Verdict.BROKEN
        fails = self.failed_on.setdefault(job_id, set())
        again = target_id in fails
        fails.add(target_id)
        if len(fails) >= 2 or (again and target_id in self._landed):
            return Verdict.QUARANTINE
        return Verdict.RETRY

    def charged(self, job_id: int) -> bool:
        """The job has strikes: it waits among the re-tries, not at the queue's front."""
        return bool(self.failed_on.get(job_id))

    def forget(self, job_id: int) -> None:
        """The job is done with (quarantined, or acked by a rollback)."""
        self.failed_on.pop(job_id, None)

    def lost(self, target_id: int) -> None:
        """The target is gone: it takes part in no last-resort decision."""
        self._known.discard(target_id)

    def reset(self, target_id: int) -> None:
        """A new incarnation of the target (a restart): no streak, not broken, nothing landed yet."""
        self.broken.discard(target_id)
        self._streak.pop(target_id, None)
        self._landed.discard(target_id)

    def _mark_broken(self, target_id: int) -> None:
        self.broken.add(target_id)
        self._known.discard(target_id)
        for job_id in self._streak.pop(target_id):
            fails = self.failed_on.get(job_id)
            if fails is not None:
                fails.discard(target_id)
                if not fails:
                    del self.failed_on[job_id]
