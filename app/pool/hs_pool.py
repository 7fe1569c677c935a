"""The hidden-state pool's policy: a plain class, no Ray.

`HSPool` is the facade the actor (`actors/hs_pool.py`) wraps; its parts each live in their own
module: the job queue (`queue.py`) over the catalog of added jobs (`catalog.py`), jobs on targets
(`inflight.py`), the bucket buffer (`buffer.py`), the lease table with its generation fences
(`leases.py`), the capacity budget in items and bytes (`budget.py`), the ledger of acked jobs
(`ledger.py`), the explicit job states (`states.py`), the bucket choice of a pull (`pull_policy.py`)
and which global step a pull belongs to (`rounds.py`); `measures.py` computes the mixing measures.
Everything here is synchronous except `pull` / `wait_changed`, which only await an asyncio.Event, so
the class is usable (and tested) without Ray.

Job life cycle (`JobState`): pending -> in_flight (on a target) -> buffered (in a bucket) -> leased
(to a drafter) -> acked. A failed target job and a released lease go back to the FRONT of the queue:
the hidden states are recomputed, never kept. Capacity rules: see `budget.py`.

Jobs arrive as whole epochs (`add_epoch(EpochJobs)`, the run's path): the pool keeps about a byte per
queued job (its state byte and two skip bits: the queue's, the catalog's) and makes a job's JobSpec
only when it issues it. `add_jobs(list[JobSpec])` keeps each JobSpec as given, for tests and benches.

Config values arrive checked (`app/config/schema.py`); the asserts here guard internal invariants.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from app.config.schema import PoolConfig
import numpy as np

from app.data.schedule import EpochJobs
from app.messages import Drained, EndOfStream, ItemMeta, JobSpec, PulledItem, make_job_id
from app.pool.budget import Budget
from app.pool.buffer import BucketBuffer, Item
from app.pool.catalog import JobCatalog
from app.pool.inflight import InFlight
from app.pool.leases import LeaseRevoked, LeaseTable
from app.pool.ledger import Ledger
from app.pool.measures import BacklogMeter, StepMix, shares_of
from app.pool.pull_policy import PullContext, PullPolicy, make_pull_policy
from app.pool.queue import JobQueue
from app.pool.rounds import RoundTracker
from app.pool.states import JobState, JobStates
from app.pool.stats import PoolStats, WaitStats

__all__ = ["Drained", "HSPool", "LeaseRevoked"]


QUARANTINE_AFTER = 2  # forward failures of one job, on any targets, before it is quarantined


@dataclass
class _TargetTally:
    done: int = 0
    tokens: int = 0
    forward_s: float = 0.0


class HSPool:
    """Job queue, per-bucket items, min-ready reservoir, bucket-fair pulls, leases and ledger."""

    def __init__(
        self,
        cfg: PoolConfig,
        num_buckets: int,
        pull_policy: str | PullPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        ranks: int | None = None,
        accum: int = 1,
    ) -> None:
        """`pull_policy`: None = `cfg.pull_policy`. `ranks` (drafters in the group; None = as many
        as pull) and `accum` (train.grad_accum) size a global step for the policy."""
        assert num_buckets >= 1, num_buckets
        self.cfg = cfg
        self.num_buckets = num_buckets
        self.policy = make_pull_policy(cfg.pull_policy if pull_policy is None else pull_policy, num_buckets)
        self._rounds = RoundTracker(accum, ranks)
        self._clock = clock
        self._rng = random.Random(cfg.seed)
        self._states = JobStates()
        self._catalog = JobCatalog()  # every job added, for re-queueing on rollback
        self._queue = JobQueue(self._catalog)
        self._in_flight = InFlight()
        self._buffer = BucketBuffer(num_buckets)
        self._leases = LeaseTable()
        self._ledger = Ledger()
        self._budget = Budget(cfg.capacity, cfg.capacity_bytes, num_buckets)
        self._adding_finished = False
        self._eos_drafters: set[int] = set()
        self._scheduled = [0] * num_buckets  # jobs added per bucket
        self._served = [0] * num_buckets
        self._produced = [0] * num_buckets
        self._targets: dict[int, _TargetTally] = {}
        self._waits = WaitStats()
        self._backlog = BacklogMeter()
        self._step_mix = StepMix(num_buckets)
        self.acked_twice = 0
        self.stale_results = 0
        self.stale_acks = 0
        self.lost_payloads = 0
        self._job_failures: dict[int, int] = {}  # job id -> forward failures (any target)
        self.quarantined: dict[int, str] = {}  # job id -> error of its last failure
        self._event = asyncio.Event()

    # ---- producing side -------------------------------------------------------------------

    def add_jobs(self, jobs: Iterable[JobSpec]) -> int:
        """Append jobs to the queue; restored (already acked) ids are skipped. Returns how many
        were queued."""
        if self._adding_finished:
            raise ValueError("add_jobs after finish_adding: add every job of the run first")
        added = [0] * self.num_buckets
        for job in jobs:
            if job.job_id in self._ledger:
                continue
            self._check_job(job)
            self._states.move(job.job_id, JobState.PENDING)
            self._queue.append(job)
            added[job.bucket] += 1
        return self._added(added)

    def add_epoch(self, jobs: EpochJobs, bytes_per_token: int = 0) -> int:
        """Queue every job of one epoch, in schedule order, without a JobSpec each (the run's path:
        `jobs` arrives zero-copy from the object store); restored (already acked) jobs are skipped.
        A job's JobSpec is made when it is issued, with est_bytes = `jobs.payload_bytes(index,
        bytes_per_token)` (`RunPlan.bytes_per_token`; 0 = unknown). Returns how many were queued."""
        if self._adding_finished:
            raise ValueError("add_epoch after finish_adding: add every job of the run first")
        skipped = self._ledger.mask(jobs.epoch, len(jobs))
        queued = ~skipped
        self._check_epoch(jobs, bytes_per_token, queued)
        self._states.add_epoch(jobs.epoch, queued)
        self._queue.append_epoch(jobs, bytes_per_token, skipped)
        return self._added(np.bincount(jobs.bucket[queued], minlength=self.num_buckets).tolist())

    def _added(self, per_bucket: list[int]) -> int:
        self._scheduled = [a + b for a, b in zip(self._scheduled, per_bucket)]
        self.policy.add_jobs(per_bucket)
        self._wake()
        return sum(per_bucket)

    def finish_adding(self) -> None:
        """No more jobs will be added: once all are produced pulls drain, once all are acked EOS."""
        self._adding_finished = True
        self._wake()

    def restore_ledger(self, acked_ids: Iterable[int]) -> None:
        """Mark jobs acked by a previous run (from a checkpoint); they are never issued again."""
        ids = set(acked_ids)
        for jid in ids:
            if jid not in self._ledger:
                self._states.move(jid, JobState.ACKED)
                self._ledger.add(jid)
        self._queue.remove(ids)
        self._wake()

    def next_job(self, target_id: int) -> JobSpec | None:
        """The next job for this target, or None if its slots are full or the pool is at capacity."""
        job = self._queue.peek()
        if job is None or self._in_flight.count(target_id) >= self.cfg.jobs_in_flight_per_target:
            return None
        reserve = self._budget.reservation(job)
        if not self._budget.fits(self._items_held, reserve):
            return None
        self._queue.pop()
        self._in_flight.start(job, target_id, self._clock(), reserve)
        self._budget.reserve(reserve)
        self._states.move(job.job_id, JobState.IN_FLIGHT)
        self._wake()
        return job

    def job_done(self, target_id: int, meta: ItemMeta, payload: Any) -> bool:
        """A target finished a job: buffer the item in its bucket. False for a stale result
        (the job was already failed back to the queue); the caller drops the payload."""
        fl = self._in_flight.get(meta.job_id)
        if fl is None or fl.target_id != target_id:
            self.stale_results += 1
            return False
        assert meta.bucket == fl.job.bucket, f"job {meta.job_id}: bucket {meta.bucket} != {fl.job.bucket}"
        self._in_flight.pop(meta.job_id)
        self._budget.land(fl.reserved_bytes, meta.nbytes, meta.bucket)
        self._buffer.put(Item(fl.job, meta, payload))
        self._states.move(meta.job_id, JobState.BUFFERED)
        self._produced[meta.bucket] += 1
        tally = self._targets.setdefault(target_id, _TargetTally())
        tally.done += 1
        tally.tokens += meta.num_tokens
        tally.forward_s += meta.forward_s
        self._buffer_changed()
        self._wake()
        return True

    def job_failed(self, target_id: int, job_id: int) -> bool:
        """A target job failed (its target died): it goes back to the front of the queue."""
        fl = self._in_flight.get(job_id)
        if fl is None or fl.target_id != target_id:
            return False
        self._requeue_in_flight([job_id])
        return True

    def job_raised(self, target_id: int, job_id: int, error: str) -> bool:
        """The job's forward raised on a live target: back to the front of the queue, or, the
        QUARANTINE_AFTER-th time it raised (on any targets), quarantined: a poison job (a token id
        beyond the vocabulary, an OOM on the one largest job) would otherwise fail on every target
        for the rest of the run. A quarantined job is never trained nor acked; `quarantined` maps
        its id to the last error. A target dying is not counted here (`job_failed`): the job that
        happened to be in flight is not to blame."""
        fl = self._in_flight.get(job_id)
        if fl is None or fl.target_id != target_id:
            return False
        self._job_failures[job_id] = self._job_failures.get(job_id, 0) + 1
        if self._job_failures[job_id] < QUARANTINE_AFTER:
            self._requeue_in_flight([job_id])
            return True
        self._budget.unreserve(self._in_flight.pop(job_id).reserved_bytes)
        self._states.move(job_id, JobState.QUARANTINED)
        self.quarantined[job_id] = error
        self._wake()
        return True

    def target_lost(self, target_id: int) -> list[int]:
        """A target died: all its in-flight jobs go back to the front of the queue."""
        ids = self._in_flight.of_target(target_id)
        self._requeue_in_flight(ids)
        return ids

    # ---- consuming side -------------------------------------------------------------------

    def try_pull(self, drafter_id: int) -> PulledItem | EndOfStream | Drained | None:
        """Lease one item to the drafter; None means wait (the reservoir is not ready)."""
        if self.done:
            self._eos_drafters.add(drafter_id)
            return EndOfStream()
        buffered = len(self._buffer)
        draining = self.producing_finished or self._stalled()
        if buffered == 0:
            # Also drain when leases hold the byte budget and nothing is in flight: the rank must
            # step with what it has and ack, or its own leases would block the next job forever.
            return self._drained(drafter_id) if draining else None
        if buffered < self.cfg.min_ready and not draining:
            return None
        rnd = self._rounds.round(drafter_id)
        ctx = PullContext(drafter_id, rnd, self._buffer.counts(), self._rounds.step_items, self.producing_finished,
                          self._rounds.open_slots(), self._rounds.ranks is not None, self._buffer.mean_costs(),
                          self._rounds.slots_in(rnd))
        bucket = self.policy.choose(ctx, self._rng)
        if bucket is None:  # the policy ends this step early (equal steps over the last items)
            return self._drained(drafter_id)
        item = self._buffer.take(bucket, self._rng, self.policy.pick(ctx, bucket, self._buffer.costs(bucket), self._rng))
        self.policy.served(ctx, bucket, item.job.cost)
        self._budget.lease(item.meta.nbytes)
        self._leases.lease(item, drafter_id, self._clock())
        self._states.move(item.meta.job_id, JobState.LEASED)
        self._rounds.took(drafter_id)
        self._served[bucket] += 1
        self._buffer_changed()
        self._wake()  # a freed item slot may let a job be issued
        return PulledItem(meta=item.meta, payload_ref=item.payload)

    async def pull(self, drafter_id: int, generation: int = 0,
                   acks: Iterable[int] = ()) -> PulledItem | EndOfStream | Drained:
        """Ack `acks` (the drafter's previous step: acks ride on its next pull, one call), then wait
        until `try_pull` gives something. Raises LeaseRevoked if this drafter's leases are released
        while it waits (its caller is presumed dead), or if the call comes from an incarnation older
        than the drafter's current `generation(drafter_id)`: Ray still runs a call that a dead
        caller sent, and it must neither ack nor lease an item to nobody."""
        self._leases.see(drafter_id)
        if generation < self._leases.generation(drafter_id):
            raise LeaseRevoked(f"drafter {drafter_id} generation {generation} was released")
        if acks:
            self.ack(drafter_id, acks)
        fence = self._leases.fence(drafter_id)
        t0 = self._clock()
        while True:
            if self._leases.fence(drafter_id) != fence:
                raise LeaseRevoked(f"drafter {drafter_id} was released while its pull waited")
            got = self.try_pull(drafter_id)
            if got is not None:
                if isinstance(got, PulledItem):
                    self._waits.add(self._clock() - t0)
                return got
            await self.wait_changed()

    def ack(self, drafter_id: int, job_ids: Iterable[int], generation: int | None = None) -> int:
        """The drafter stepped on these jobs: they join the ledger. Returns how many were acked.
        Acking an acked id is counted (`acked_twice`), never fatal; an id not leased to this
        drafter (e.g. released meanwhile) is ignored and counted in `stale_acks`, and so is every id
        of a call from an incarnation older than `generation(drafter_id)` (fenced like `pull`)."""
        job_ids = list(job_ids)
        if generation is not None and generation < self._leases.generation(drafter_id):
            self.stale_acks += len(job_ids)
            return 0
        n = 0
        for jid in job_ids:
            if jid in self._ledger:
                self.acked_twice += 1
            elif self._leases.holder(jid) != drafter_id:
                self.stale_acks += 1
            else:
                self._ack_lease(jid)
                n += 1
        self._wake()
        return n

    def payload_lost(self, drafter_id: int, job_id: int, generation: int | None = None) -> bool:
        """The drafter could not read a leased payload (its node died with the object): the job goes
        back to the front of the queue to be recomputed, without rebuilding the drafter group. A call
        from an older incarnation than `generation(drafter_id)` is refused: the job id may now be
        leased to the new incarnation under the same drafter id, and re-queueing it would train it twice."""
        if generation is not None and generation < self._leases.generation(drafter_id):
            return False
        if self._leases.holder(job_id) != drafter_id:
            return False
        self._requeue_leases([job_id])
        self._rounds.untake(drafter_id)  # it pulls again for the same micro-batch
        self.lost_payloads += 1
        self._wake()
        return True

    def release(self, drafter_id: int) -> list[int]:
        """Return all the drafter's unacked jobs to the front of the queue (payloads dropped,
        recomputed later) and fence its waiting pulls."""
        ids = [ls.item.meta.job_id for ls in self._leases.of(drafter_id)]
        self._requeue_leases(ids)  # oldest lease first at the front
        self._leases.bump(drafter_id)
        self._rounds.restart(drafter_id)
        self._wake()
        return ids

    def reset_drafters(self) -> list[int]:
        """For a drafter-group rebuild: release every drafter and forget who got end-of-stream,
        so the new group's drafters get it too. Returns the requeued job ids."""
        ids: list[int] = []
        for d in self._leases.drafters():
            ids += self.release(d)
        self._leases.bump_group()
        self._eos_drafters.clear()
        self._rounds.reset()
        self.policy.reset()
        self._wake()
        return ids

    def set_ranks(self, ranks: int | None) -> None:
        """The drafter group now has `ranks` ranks (a rebuild on fewer GPUs): steps are that big."""
        self._rounds.ranks = ranks

    def rollback(self, keep_ids: Iterable[int]) -> int:
        """A drafter group rebuilt from a checkpoint whose ledger is `keep_ids`: every lease and every
        job acked after that checkpoint goes back to the front of the queue (in schedule order),
        since the restored weights never saw them. A lease whose job is in `keep_ids` was trained
        into the checkpoint before its ack reached the pool (acks ride on the next pull): it is acked
        now, not re-queued. Returns how many were re-queued."""
        keep = set(keep_ids)
        for d in self._leases.drafters():
            for lease in self._leases.of(d):
                if lease.item.meta.job_id in keep:
                    self._ack_lease(lease.item.meta.job_id)
        n = len(self.reset_drafters())
        undo = [j for j in self._ledger.not_in(keep) if j in self._catalog]  # sorted: schedule order
        for job_id in undo:
            self._ledger.discard(job_id)
            self._states.move(job_id, JobState.PENDING)
        self._queue.push_front(undo)  # schedule order at the front
        self._wake()
        return n + len(undo)

    # ---- queries --------------------------------------------------------------------------

    def ledger(self) -> list[int]:
        """Acked job ids, sorted: saved with each checkpoint."""
        return self._ledger.ids()

    def in_flight_count(self, target_id: int) -> int:
        return self._in_flight.count(target_id)

    def generation(self, drafter_id: int) -> int:
        """The incarnation a (re)started drafter passes to `pull`; bumped by each release."""
        return self._leases.generation(drafter_id)

    @property
    def buffered_count(self) -> int:
        return len(self._buffer)

    @property
    def pool_bytes(self) -> int:
        """Object-store bytes the pool holds or has reserved: buffered + leased + in flight."""
        return self._budget.total

    @property
    def bytes_overshoot(self) -> int:
        return self._budget.overshoot

    @property
    def producing_finished(self) -> bool:
        """Every job is produced: nothing pending, nothing in flight, no more coming."""
        return self._adding_finished and not self._queue and not self._in_flight

    @property
    def done(self) -> bool:
        """Every job is acked."""
        return self.producing_finished and not self._buffer and not self._leases

    def eos_drafters(self) -> list[int]:
        return sorted(self._eos_drafters)

    def record_step(self, step: int, job_ids: Iterable[int]) -> None:
        """One rank's step report (the jobs it trained): feeds the step-mix measure."""
        self._step_mix.add(step, (self._catalog.bucket(j) for j in job_ids if j in self._catalog))

    def data_shares(self) -> list[float]:
        """Each bucket's share of the scheduled jobs."""
        return shares_of(self._scheduled)

    def stats(self) -> PoolStats:
        now = self._clock()
        by_target = self._in_flight.by_target()
        n = self._states.counts()
        shares = self.data_shares()
        return PoolStats(
            q_hsb=self._buffer.counts(),
            pool_bytes=self.pool_bytes,
            capacity_bytes=self.cfg.capacity_bytes,
            capacity_items=self.cfg.capacity,
            pending=n["pending"],
            in_flight=n["in_flight"],
            buffered=n["buffered"],
            leased=n["leased"],
            acked=n["acked"],
            total_jobs=len(self._states),
            pull_waits=self._waits.snapshot(),
            served_per_bucket=list(self._served),
            produced_per_bucket=list(self._produced),
            in_flight_by_target=by_target,
            oldest_in_flight_age_s={t: now - min(s for _, s in v) for t, v in by_target.items()},
            done_by_target={t: c.done for t, c in self._targets.items()},
            tokens_by_target={t: c.tokens for t, c in self._targets.items()},
            forward_s_by_target={t: c.forward_s for t, c in self._targets.items()},
            leased_by_drafter=self._leases.count_by_drafter(),
            acked_twice=self.acked_twice,
            stale_results=self.stale_results,
            stale_acks=self.stale_acks,
            lost_payloads=self.lost_payloads,
            quarantined=dict(self.quarantined),
            bytes_overshoot=self.bytes_overshoot,
            producing_finished=self.producing_finished,
            done=self.done,
            eos_drafters=self.eos_drafters(),
            data_shares=shares,
            step_mix_tv=self._step_mix.mean_tv(shares),
            steps_measured=self._step_mix.count,
            backlog_share=self._backlog.value(now),
            backlog_integral=self._backlog.integral,
            backlog_seconds=self._backlog.seconds,
        )

    # ---- change notification --------------------------------------------------------------

    async def wait_changed(self) -> None:
        """Return after the next state change (a job issued, landed, failed; a pull, ack, ...)."""
        await self._event.wait()

    def notify(self) -> None:
        """Wake every waiter (for state the shell changes, e.g. a target registered)."""
        self._wake()

    def _wake(self) -> None:
        # Swap in a fresh event before setting the old one: waiters that re-check and wait again
        # wait on the new event, so no wake-up is lost and none spins.
        ev, self._event = self._event, asyncio.Event()
        ev.set()

    # ---- internals ------------------------------------------------------------------------

    @property
    def _items_held(self) -> int:
        """Items that count against pool.capacity: buffered + in flight."""
        return len(self._buffer) + len(self._in_flight)

    def _drained(self, drafter_id: int) -> Drained:
        self._rounds.step_ended(drafter_id)
        return Drained()

    def _buffer_changed(self) -> None:
        self._backlog.update(self._clock(), self._buffer.counts(), active=not self.producing_finished)

    def _stalled(self) -> bool:
        """Nothing in flight and the next job does not fit: waiting for min_ready would deadlock
        (leases hold the bytes, and they are acked only after pulls succeed), so pulls drain."""
        job = self._queue.peek()
        if self._in_flight or job is None:
            return False
        return not self._budget.fits(self._items_held, self._budget.reservation(job))

    def _ack_lease(self, job_id: int) -> None:
        lease = self._leases.pop(job_id)
        self._budget.unlease(lease.item.meta.nbytes)
        self._ledger.add(job_id)
        self._states.move(job_id, JobState.ACKED)

    def _requeue_leases(self, job_ids: list[int]) -> None:
        """Leases back to the front of the queue, in the given order; payloads are dropped."""
        for jid in job_ids:
            lease = self._leases.pop(jid)
            self._budget.unlease(lease.item.meta.nbytes)
            self._states.move(jid, JobState.PENDING)
        self._queue.push_front(job_ids)

    def _requeue_in_flight(self, job_ids: list[int]) -> None:
        fls = sorted((self._in_flight.pop(j) for j in job_ids), key=lambda fl: fl.start)
        for fl in fls:
            self._budget.unreserve(fl.reserved_bytes)
            self._states.move(fl.job.job_id, JobState.PENDING)
        self._queue.push_front(fl.job.job_id for fl in fls)
        self._wake()

    def _check_job(self, job: JobSpec) -> None:
        """Jobs come from the driver's schedule; these name the fix when a caller builds them wrong."""
        if job.job_id in self._states:
            raise ValueError(_twice(job.job_id))
        if not 0 <= job.bucket < self.num_buckets:
            raise ValueError(self._bad_bucket(job.job_id, job.bucket))
        if job.est_bytes > self.cfg.capacity_bytes:
            raise ValueError(self._too_big(job.job_id, job.est_bytes))

    def _check_epoch(self, jobs: EpochJobs, bytes_per_token: int, queued: np.ndarray) -> None:
        """`_check_job` for the queued jobs of a whole epoch, vectorised; the first bad job is named."""
        def first(bad: np.ndarray) -> int | None:
            hit = np.flatnonzero(queued & bad)
            return int(hit[0]) if hit.size else None

        n = len(jobs)
        if self._catalog.has_epoch(jobs.epoch):
            raise ValueError(_twice(make_job_id(jobs.epoch, 0)))
        if (k := first(self._states.known(jobs.epoch, n))) is not None:
            raise ValueError(_twice(make_job_id(jobs.epoch, k)))
        if (k := first(jobs.bucket >= self.num_buckets)) is not None:
            raise ValueError(self._bad_bucket(make_job_id(jobs.epoch, k), int(jobs.bucket[k])))
        if (k := first(jobs.all_payload_bytes(bytes_per_token) > self.cfg.capacity_bytes)) is not None:
            raise ValueError(self._too_big(make_job_id(jobs.epoch, k), jobs.payload_bytes(k, bytes_per_token)))

    def _bad_bucket(self, job_id: int, bucket: int) -> str:
        return (f"job {job_id} has bucket {bucket}, outside 0..{self.num_buckets - 1}: "
                "build the pool with num_buckets = len(data.bucket_boundaries)")

    def _too_big(self, job_id: int, est_bytes: int) -> str:
        return (f"job {job_id} needs ~{est_bytes} bytes, more than pool.capacity_bytes="
                f"{self.cfg.capacity_bytes}: raise pool.capacity_bytes or lower data.tokens_per_job")


def _twice(job_id: int) -> str:
    return f"job {job_id} added twice: job ids must be unique across epochs"
