# Over 300 lines: the producing and the drafters' sides hand jobs to each other over one book.
"""The pool's two sides over its book (`book.py`): the targets' side (`Production`: which job a target gets
and what becomes of it) and the drafters' side (`Drafters`: what a pull gets, acks, releases, rollbacks and
the rounds of the global step), which asks the producing side whether every job is produced (or production
stalled) and hands it back the in-flight jobs a rollback acks.

Production: jobs on their way to the buffer are issued to a target within the capacity budget, land in
their bucket, or fail back to the FRONT of the queue (the hidden states are recomputed, never kept).

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

Drafters: what a pull gets, the leases until the acks, and recovery when a drafter or its group fails.
A pull gets end-of-stream once every job is acked; nothing (wait) while the reservoir holds fewer
than `min_ready` items; a drained step when nothing more will come for it; else one buffered item,
from the bucket the pull policy picks for this drafter's round of the global step, leased to the
drafter. Each ack moves a job into the ledger; a released or lost lease sends its job back to the
FRONT of the queue (the payload is dropped, recomputed later). Calls from an incarnation older than
the drafter's generation (the fences: `holdings.py`) change nothing.

Recovery: re-queueing a payload a drafter lost, releasing a drafter's leases, resetting the group for
a rebuild, and rolling the pool back to a checkpoint's ledger. Every job the restored weights never
saw goes back to the FRONT of the queue (its hidden states are recomputed, never kept); every job
they did see is acked, whatever its state, so it is never trained twice.

Rounds: which global step each pull belongs to, inferred from the drafters' pull pattern. A drafter
pulls exactly grad_accum items per optimizer step, one outstanding pull at a time, unless a pull
returns `Drained`, after which it steps with what it holds. So the pool can number each drafter's
steps by counting: after `accum` items, or a Drained, its next pull opens the next round. The ranks
run in lockstep, so round r of every rank is the same global step. A payload lost in transit is
pulled again for the same slot; a rebuilt group starts every rank at a fresh round.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any

from app.messages import Drained, EndOfStream, ItemMeta, JobSpec, PulledItem
from app.pool.book import JobBook, JobState
from app.pool.holdings import Item
from app.pool.pull_policy import PullContext, PullPolicy


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


class Drafters:
    """Pulls, acks, releases and rollbacks over the pool's book; owns the rounds, the pull policy's
    random stream and who got end-of-stream. Asks `production` whether every job is produced (and
    whether it stalled), and hands it back in-flight jobs a rollback acks."""

    def __init__(self, book: JobBook, production: Production, policy: PullPolicy, rounds: RoundTracker,
                 min_ready: int, seed: int) -> None:
        self.rounds = rounds
        self.eos: set[int] = set()  # drafters that got end-of-stream
        self.leases = book.leases  # generations and fences
        self._book, self._production, self._policy = book, production, policy
        self._min_ready, self._rng = min_ready, random.Random(seed)
        self._buffer, self._states, self._ledger, self._tel = book.buffer, book.states, book.ledger, book.tel

    @property
    def done(self) -> bool:
        """Every job is acked."""
        return self._production.finished and not self._buffer and not self.leases

    # ---- pulls ----------------------------------------------------------------------------

    def try_pull(self, drafter_id: int) -> PulledItem | EndOfStream | Drained | None:
        """Lease one item to the drafter; None means wait (the reservoir is not ready)."""
        if self.done:
            self.eos.add(drafter_id)
            return EndOfStream()
        buffered = len(self._buffer)
        finished = self._production.finished
        draining = finished or self._production.stalled()
        if buffered == 0:
            # Also drain when leases hold the byte budget and nothing is in flight: the rank must
            # step with what it has and ack, or its own leases would block the next job forever.
            return self._drained(drafter_id) if draining else None
        if buffered < self._min_ready and not draining:
            return None
        rnd = self.rounds.round(drafter_id)
        ctx = PullContext(drafter_id, rnd, self._buffer.counts(), self.rounds.step_items, finished,
                          self.rounds.open_slots(), self.rounds.ranks is not None, self._buffer.mean_costs(),
                          self.rounds.slots_in(rnd))
        bucket = self._policy.choose(ctx, self._rng)
        if bucket is None:  # the policy ends this step early (equal steps over the last items)
            return self._drained(drafter_id)
        item = self._buffer.take(bucket, self._rng,
                                 self._policy.pick(ctx, bucket, self._buffer.costs(bucket), self._rng))
        self._policy.served(ctx, bucket, item.job.cost)
        self._lend(item, drafter_id)
        self.rounds.took(drafter_id)
        self._tel.served[bucket] += 1
        self._production.buffer_changed()
        self._book.changed()  # a freed item slot may let a job be issued
        return PulledItem(meta=item.meta, payload_ref=item.payload)

    def _drained(self, drafter_id: int) -> Drained:
        self.rounds.step_ended(drafter_id)
        return Drained()

    def _lend(self, item: Item, drafter_id: int) -> None:
        self._book.budget.lease(item.meta.nbytes)
        self.leases.lease(item, drafter_id, self._book.clock())
        self._states.move(item.meta.job_id, JobState.LEASED)

    # ---- acks and lost leases -------------------------------------------------------------

    def outdated(self, drafter_id: int, generation: int | None) -> bool:
        """The call comes from an incarnation older than the drafter's current one."""
        return generation is not None and generation < self.leases.generation(drafter_id)

    def ack(self, drafter_id: int, job_ids: list[int], generation: int | None) -> int:
        """Ack the ids leased to this drafter; count the rest (stale, or acked twice)."""
        if self.outdated(drafter_id, generation):
            self._tel.stale_acks += len(job_ids)
            return 0
        n = 0
        for jid in job_ids:
            if jid in self._ledger:
                self._tel.acked_twice += 1
            elif self.leases.holder(jid) != drafter_id:
                self._tel.stale_acks += 1
            else:
                self._ack_one(jid)
                n += 1
        return n

    def _ack_one(self, job_id: int) -> None:
        lease = self.leases.pop(job_id)
        self._book.budget.unlease(lease.item.meta.nbytes)
        self._ledger.add(job_id)
        self._states.move(job_id, JobState.ACKED)

    def payload_lost(self, drafter_id: int, job_id: int, generation: int | None) -> bool:
        """One lease whose payload the drafter could not read back to the queue; False if the call is
        outdated or the lease not its own. The drafter pulls again for the same micro-batch."""
        if self.outdated(drafter_id, generation) or self.leases.holder(job_id) != drafter_id:
            return False
        self._requeue([job_id])
        self._tel.lost_payloads += 1
        self.rounds.untake(drafter_id)
        self._book.changed()
        return True

    def _requeue(self, job_ids: Iterable[int]) -> None:
        """Leases back to the front of the queue, in the given order; payloads are dropped."""
        job_ids = list(job_ids)
        for jid in job_ids:
            lease = self.leases.pop(jid)
            self._book.budget.unlease(lease.item.meta.nbytes)
            self._states.move(jid, JobState.PENDING)
        self._book.queue.push_front(job_ids)

    # ---- recovery -------------------------------------------------------------------------

    def release(self, drafter_id: int) -> list[int]:
        """Every unacked job of the drafter back to the front of the queue (oldest first); its waiting
        pulls fenced."""
        ids = [ls.item.meta.job_id for ls in self.leases.of(drafter_id)]
        self._requeue(ids)
        self.leases.bump(drafter_id)
        self.rounds.restart(drafter_id)
        self._book.changed()
        return ids

    def reset(self) -> list[int]:
        """Release every drafter and forget who got end-of-stream; returns the requeued job ids."""
        ids: list[int] = []
        for d in self.leases.drafters():
            ids += self.release(d)
        self.leases.bump_group()
        self.eos.clear()
        self.rounds.reset()
        self._policy.reset()
        self._book.changed()
        return ids

    def rollback(self, keep_ids: Iterable[int]) -> int:
        """A drafter group rebuilt from a checkpoint whose ledger is `keep_ids`: every lease and every
        job acked after that checkpoint goes back to the front of the queue (in schedule order),
        since the restored weights never saw them. A lease whose job is in `keep_ids` was trained
        into the checkpoint before its ack reached the pool (acks ride on the next pull): it is acked
        now, not re-queued. So is every other id of `keep`, whatever its state (pending after an earlier
        rollback, in flight, buffered): the restored weights trained it, and issuing it again would
        train it twice. Returns how many were re-queued."""
        keep = set(keep_ids)
        self._ack_kept(keep)
        n = len(self.reset())
        undo = [j for j in self._ledger.not_in(keep) if j in self._book.catalog]  # sorted: schedule order
        for job_id in undo:
            self._ledger.discard(job_id)
            self._states.move(job_id, JobState.PENDING)
        self._book.queue.push_front(undo)  # schedule order at the front
        self._ack_unacked(keep)
        self._book.changed()
        return n + len(undo)

    def _ack_unacked(self, keep: set[int]) -> None:
        """Ack the ids of a kept ledger that are not acked (quarantined ones stay: never trained)."""
        queued: set[int] = set()
        for job_id in keep:
            state = self._states.get(job_id)
            if state in (None, JobState.ACKED, JobState.QUARANTINED, JobState.LEASED):
                continue  # leases were acked or released just before; unknown ids are not this run's
            if state is JobState.BUFFERED:
                item = self._buffer.remove(job_id, self._book.catalog.bucket(job_id))
                assert item is not None, f"job {job_id} buffered but not in its bucket"
                self._book.budget.unbuffer(item.meta.nbytes)
            elif not self._production.take_back(job_id):
                queued.add(job_id)
            self._states.move(job_id, JobState.ACKED)
            self._ledger.add(job_id)
        self._book.queue.remove(queued)
        self._production.buffer_changed()

    def _ack_kept(self, keep: set[int]) -> None:
        """Ack the leases whose jobs a checkpoint already holds (trained before their ack arrived)."""
        for d in self.leases.drafters():
            for lease in self.leases.of(d):
                if lease.item.meta.job_id in keep:
                    self._ack_one(lease.item.meta.job_id)


class RoundTracker:
    """Each drafter's round (global step) and the items it took in it (the rules above)."""

    def __init__(self, accum: int = 1, ranks: int | None = None) -> None:
        assert accum >= 1, accum
        self.accum = accum
        self.ranks = ranks  # None: as many as have pulled since the last reset
        self._round: dict[int, int] = {}
        self._taken: dict[int, int] = {}  # items in the drafter's current round
        self._base = 0

    def round(self, drafter_id: int) -> int:
        return self._round.setdefault(drafter_id, self._base)

    @property
    def step_items(self) -> int:
        """Items of one global step: ranks x grad_accum."""
        return max(1, self.ranks or len(self._round)) * self.accum

    def open_slots(self) -> dict[int, int]:
        """round -> items its ranks may still pull in it."""
        out: dict[int, int] = {}
        for d, r in self._round.items():
            out[r] = out.get(r, 0) + self.accum - self._taken.get(d, 0)
        return out

    def slots_in(self, rnd: int) -> dict[int, int]:
        """rank -> items it will still pull in round `rnd` (ranks not seen yet count as -1, -2, ...)."""
        out = {}
        for d, r in self._round.items():
            out[d] = self.accum - self._taken.get(d, 0) if r == rnd else (self.accum if r < rnd else 0)
        for k in range(max(0, (self.ranks or 0) - len(out))):
            out[-1 - k] = self.accum
        return out

    def took(self, drafter_id: int) -> None:
        r = self.round(drafter_id)
        n = self._taken.get(drafter_id, 0) + 1
        if n >= self.accum:
            self._round[drafter_id], n = r + 1, 0
        self._taken[drafter_id] = n

    def step_ended(self, drafter_id: int) -> None:
        """The drafter got Drained: it steps now, whatever it holds."""
        self._round[drafter_id] = self.round(drafter_id) + 1
        self._taken[drafter_id] = 0

    def untake(self, drafter_id: int) -> None:
        """The drafter's last item is lost and it pulls again for the same slot."""
        n = self._taken.get(drafter_id, 0)
        if n > 0:
            self._taken[drafter_id] = n - 1
        elif self.round(drafter_id) > self._base:
            self._round[drafter_id] -= 1
            self._taken[drafter_id] = self.accum - 1

    def restart(self, drafter_id: int) -> None:
        """One drafter restarted on its own: it joins the others' current round."""
        others = [r for d, r in self._round.items() if d != drafter_id]
        self._round[drafter_id] = max(others, default=self._base)
        self._taken[drafter_id] = 0

    def reset(self) -> None:
        """A rebuilt group: every rank starts a fresh round, past every round seen."""
        self._base = max(self._round.values(), default=self._base) + 2
        self._round.clear()
        self._taken.clear()
