"""The hidden-state pool: a plain class, no Ray. (Over 300 lines: the facade's one method per pool call, and this map.)

`HSPool` is the facade the actor (`actors/hs_pool.py`) wraps; its parts each live in their own
module: jobs entering (`intake.py`), the job queue (`queue.py`) over the catalog of added jobs
(`catalog.py`), jobs on targets (`production.py`), the bucket buffer (`buffer.py`), what a pull gets
(`serving.py`), the leases (`lending.py` over `leases.py`, with its generation fences), releases and
rollbacks (`recovery.py`), the capacity budget in items and bytes (`budget.py`), the ledger of acked
jobs (`ledger.py`), the explicit job states (`states.py`), the bucket choice of a pull
(`pull_policy.py`), which global step a pull belongs to (`rounds.py`), and the counters and meters
behind `stats()` (`telemetry.py`, with the mixing measures of `measures.py`).
The actor's own state (targets, pauses, eval offers, the stop flag, step records) is `control.py`.
Everything here is synchronous except `pull` / `wait_changed`, which only await an asyncio.Event, so
the class is usable (and tested) without Ray.

Job life cycle (`JobState`): pending -> in_flight (on a target) -> buffered (in a bucket) -> leased
(to a drafter) -> acked. A failed target job and a released lease go back to the FRONT of the queue:
the hidden states are recomputed, never kept. Capacity rules: see `budget.py`.

Jobs arrive as whole epochs (`add_epoch(EpochJobs)`, the run's path): the pool keeps about a byte per
queued job (its state byte and two skip bits: the queue's, the catalog's) and makes a job's JobSpec
only when it issues it. `add_jobs(list[JobSpec])` keeps each JobSpec as given, for tests and benches.

Config values arrive checked (`app/config/schema.py`); the asserts here guard internal invariants.

Several drafter runs on one capture stream keep one HSPool each under `stream.py` (the producing side
for all of them), which reaches in through `stream_side` and `job_state`.

The module runs past 300 lines on purpose: the HSPool class is 270, and this docstring is the map of the
pool's parts that a reader needs before any of them.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

from app.config.schema import PoolConfig
from app.data.schedule import EpochJobs
from app.messages import Drained, EndOfStream, ItemMeta, JobSpec, PulledItem
from app.pool.book import JobQueue
from app.pool.drafters import Recovery
from app.pool.holdings import BucketBuffer, Budget, LeaseRevoked
from app.pool.intake import Intake
from app.pool.lending import Lending
from app.pool.production import Production
from app.pool.pull_policy import PullPolicy, make_pull_policy
from app.pool.records import JobCatalog, JobState, JobStates, Ledger
from app.pool.rounds import RoundTracker
from app.pool.serving import Serving
from app.pool.telemetry import PoolStats, PoolTelemetry

__all__ = ["Drained", "HSPool", "LeaseRevoked"]


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
        queue: Callable[[JobCatalog], JobQueue] = JobQueue,
        broken_after: int = 3,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        """`pull_policy`: None = `cfg.pull_policy`. `ranks` (drafters in the group; None = as many
        as pull) and `accum` (train.grad_accum) size a global step for the policy. `queue` builds
        the job queue over the catalog (a test passes a reference queue). `broken_after`: raises in a
        row that make a target broken (supervision.broken_target_raises; see `strikes.py`). `on_change`:
        called on every state change (the shared stream of several runs wakes its dispatch with it)."""
        assert num_buckets >= 1, num_buckets
        self.cfg = cfg
        self.num_buckets = num_buckets
        self.policy = make_pull_policy(cfg.pull_policy if pull_policy is None else pull_policy, num_buckets)
        self._rounds = RoundTracker(accum, ranks)
        self._clock = clock
        self._states = JobStates()
        self._catalog = JobCatalog()  # every job added, for re-queueing on rollback
        self._queue = queue(self._catalog)
        self._buffer = BucketBuffer(num_buckets)
        self._ledger = Ledger()
        self._budget = Budget(cfg.capacity, cfg.capacity_bytes, num_buckets)
        self._tel = PoolTelemetry(num_buckets)
        self._lending = Lending(self._states, self._budget, self._ledger, self._queue, self._tel)
        self._leases = self._lending.leases  # generations and fences
        self._intake = Intake(num_buckets, cfg.capacity_bytes, self._queue, self._states, self._catalog, self._ledger)
        self._production = Production(cfg.jobs_in_flight_per_target, self._queue, self._states, self._buffer,
                                      self._budget, self._tel, clock, self._wake, broken_after)
        self._eos_drafters: set[int] = set()
        self._serving = Serving(cfg.min_ready, cfg.seed, self.policy, self._rounds, self._buffer, self._lending,
                                self._production, self._tel, self._eos_drafters, clock,
                                lambda: self.producing_finished, lambda: self.done, self._wake, self._buffer_changed)
        self._recovery = Recovery(self._lending, self._rounds, self.policy, self._eos_drafters, self._production,
                                  self._states, self._catalog, self._queue, self._buffer, self._budget,
                                  self._ledger, self._wake, self._buffer_changed)
        self._event = asyncio.Event()
        self._on_change = on_change

    # ---- producing side -------------------------------------------------------------------

    def add_jobs(self, jobs: Iterable[JobSpec]) -> int:
        """Append jobs to the queue; restored (already acked) ids are skipped. Returns how many
        were queued."""
        return self._added(self._intake.add_jobs(jobs))

    def add_epoch(self, jobs: EpochJobs, bytes_per_token: int = 0) -> int:
        """Queue every job of one epoch, in schedule order, without a JobSpec each (the run's path:
        `jobs` arrives zero-copy from the object store); restored (already acked) jobs are skipped.
        A job's JobSpec is made when it is issued, with est_bytes = `jobs.payload_bytes(index,
        bytes_per_token)` (`RunPlan.bytes_per_token`; 0 = unknown). Returns how many were queued."""
        return self._added(self._intake.add_epoch(jobs, bytes_per_token))

    def _added(self, per_bucket: list[int]) -> int:
        self._tel.added(per_bucket)
        self.policy.add_jobs(per_bucket)
        self._wake()
        return sum(per_bucket)

    def finish_adding(self) -> None:
        """No more jobs will be added: once all are produced pulls drain, once all are acked EOS."""
        self._intake.finished = True
        self._wake()

    def restore_ledger(self, acked_ids: Iterable[int]) -> None:
        """Mark jobs acked by a previous run (from a checkpoint); they are never issued again."""
        self._intake.restore(acked_ids)
        self._wake()

    def next_job(self, target_id: int) -> JobSpec | None:
        """The next job for this target, or None if its slots are full or the pool is at capacity."""
        return self._production.next_job(target_id)

    def job_done(self, target_id: int, meta: ItemMeta, payload: Any) -> bool:
        """A target finished a job: buffer the item in its bucket. False for a stale result
        (the job was already failed back to the queue); the caller drops the payload."""
        if not self._production.land(target_id, meta, payload):
            return False
        self._buffer_changed()
        self._wake()
        return True

    def job_failed(self, target_id: int, job_id: int) -> bool:
        """A target job failed (its target died): it goes back to the front of the queue."""
        return self._production.failed(target_id, job_id)

    def job_raised(self, target_id: int, job_id: int, error: str) -> bool:
        """The job's forward raised on a live target: re-tried on another target, quarantined (listed
        in `stats().quarantined`), or not charged when the target is broken (`stats().broken_targets`);
        the rules: `Production.raised`. A target dying is `job_failed` instead."""
        return self._production.raised(target_id, job_id, error)

    def stream_side(self) -> Production:
        """The production part, for the shared stream of several runs (`stream.py`): it picks a job with
        `candidate`, checks `fits` and `issue`s it to every run that still needs it."""
        return self._production

    def job_state(self, job_id: int) -> JobState | None:
        return self._states.get(job_id)

    @property
    def broken_after(self) -> int:
        return self._production.strikes.broken_after

    def target_broken(self, target_id: int) -> bool:
        """Whether the target raised `broken_after` times in a row (until `target_added` again)."""
        return target_id in self._production.strikes.broken

    def target_added(self, target_id: int) -> None:
        """A (new incarnation of a) target registered: it starts with no raise streak, not broken."""
        self._production.target_added(target_id)

    def target_lost(self, target_id: int) -> list[int]:
        """A target died: all its in-flight jobs go back to the front of the queue."""
        return self._production.target_lost(target_id)

    # ---- consuming side -------------------------------------------------------------------

    def try_pull(self, drafter_id: int) -> PulledItem | EndOfStream | Drained | None:
        """Lease one item to the drafter; None means wait (the reservoir is not ready). See `serving.py`."""
        return self._serving.try_pull(drafter_id)

    async def pull(self, drafter_id: int, generation: int = 0,
                   acks: Iterable[int] = ()) -> PulledItem | EndOfStream | Drained:
        """Ack `acks` (the drafter's previous step: acks ride on its next pull, one call), then wait
        until `try_pull` gives something. Raises LeaseRevoked if this drafter's leases are released
        while it waits (its caller is presumed dead), or if the call comes from an incarnation older
        than the drafter's current `generation(drafter_id)`: Ray still runs a call that a dead
        caller sent, and it must neither ack nor lease an item to nobody."""
        self._leases.see(drafter_id)
        if self._lending.outdated(drafter_id, generation):
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
                    self._tel.waits.add(self._clock() - t0)  # the one pull-wait measurement
                return got
            await self.wait_changed()

    def ack(self, drafter_id: int, job_ids: Iterable[int], generation: int | None = None) -> int:
        """The drafter stepped on these jobs: they join the ledger. Returns how many were acked.
        Acking an acked id is counted (`acked_twice`), never fatal; an id not leased to this
        drafter (e.g. released meanwhile) is ignored and counted in `stale_acks`, and so is every id
        of a call from an incarnation older than `generation(drafter_id)` (fenced like `pull`)."""
        n = self._lending.ack(drafter_id, list(job_ids), generation)
        self._wake()
        return n

    def payload_lost(self, drafter_id: int, job_id: int, generation: int | None = None) -> bool:
        """The drafter could not read a leased payload (its node died with the object): the job goes
        back to the front of the queue to be recomputed, without rebuilding the drafter group. A call
        from an older incarnation than `generation(drafter_id)` is refused: the job id may now be
        leased to the new incarnation under the same drafter id, and re-queueing it would train it twice."""
        return self._recovery.payload_lost(drafter_id, job_id, generation)

    def release(self, drafter_id: int) -> list[int]:
        """Return all the drafter's unacked jobs to the front of the queue (payloads dropped,
        recomputed later) and fence its waiting pulls."""
        return self._recovery.release(drafter_id)

    def reset_drafters(self) -> list[int]:
        """For a drafter-group rebuild: release every drafter and forget who got end-of-stream,
        so the new group's drafters get it too. Returns the requeued job ids."""
        return self._recovery.reset_drafters()

    def set_ranks(self, ranks: int | None) -> None:
        """The drafter group now has `ranks` ranks (a rebuild on fewer GPUs): steps are that big."""
        self._rounds.ranks = ranks

    def rollback(self, keep_ids: Iterable[int]) -> int:
        """A drafter group rebuilt from a checkpoint whose ledger is `keep_ids`: jobs it never saw go
        back to the front of the queue, jobs it saw are acked whatever their state (the rules:
        `Recovery.rollback`). Returns how many were re-queued."""
        return self._recovery.rollback(keep_ids)

    # ---- queries --------------------------------------------------------------------------

    def ledger(self) -> list[int]:
        """Acked job ids, sorted: saved with each checkpoint."""
        return self._ledger.ids()

    def in_flight_count(self, target_id: int) -> int:
        return self._production.in_flight.count(target_id)

    def generation(self, drafter_id: int) -> int:
        """The incarnation a (re)started drafter passes to `pull`; bumped by each release."""
        return self._leases.generation(drafter_id)

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
        return self._intake.finished and not self._production.waiting and not self._production.in_flight

    @property
    def done(self) -> bool:
        """Every job is acked."""
        return self.producing_finished and not self._buffer and not self._leases

    def eos_drafters(self) -> list[int]:
        return sorted(self._eos_drafters)

    def record_step(self, step: int, job_ids: Iterable[int]) -> None:
        """One rank's step report (the jobs it trained): feeds the step-mix measure."""
        self._tel.record_step(step, (self._catalog.bucket(j) for j in job_ids if j in self._catalog))

    def drain_pull_waits(self) -> list[float]:
        """Seconds each successful pull waited, since the previous drain (the metrics histogram)."""
        return self._tel.waits.drain()

    def stats(self) -> PoolStats:
        """One consistent snapshot: job states, buffer, bytes, in-flight ages, leases, telemetry."""
        now = self._clock()
        by_target = self._production.in_flight.by_target()
        n = self._states.counts()
        return PoolStats(
            q_hsb=self._buffer.counts(), pool_bytes=self.pool_bytes, capacity_bytes=self.cfg.capacity_bytes,
            capacity_items=self.cfg.capacity, pending=n["pending"], in_flight=n["in_flight"],
            buffered=n["buffered"], leased=n["leased"], acked=n["acked"], total_jobs=len(self._states),
            in_flight_by_target=by_target,
            oldest_in_flight_age_s={t: now - min(s for _, s in v) for t, v in by_target.items()},
            leased_by_drafter=self._leases.count_by_drafter(), quarantined=dict(self._production.quarantined),
            broken_targets=sorted(self._production.strikes.broken),
            bytes_overshoot=self.bytes_overshoot, producing_finished=self.producing_finished, done=self.done,
            eos_drafters=self.eos_drafters(), **self._tel.fields(now),
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
        if self._on_change is not None:
            self._on_change()

    # ---- internals ------------------------------------------------------------------------

    def _buffer_changed(self) -> None:
        self._tel.backlog.update(self._clock(), self._buffer.counts(), active=not self.producing_finished)
