"""The hidden-state pool: a plain class, no Ray.

`HSPool` is one run's pool: the facade the actor (`actors/hs_pool.py`) wraps, one method per pool
call, over three parts: the book of every job and where it is (`book.py`: job states, catalog, queue,
jobs in flight, ledger, with the buffer, leases, byte budget and counters), which both sides share; and
the two sides (`sides.py`): the producing side (which job a target gets, what becomes of it, the strikes
of raised forwards) and the drafters' side (what a pull gets, acks, releases and rollbacks, the rounds
of the global step). Beside them: what the pool holds and its byte budget (`holdings.py`), the bucket
choice of a pull (`pull_policy.py`), the counters, meters and snapshot (`telemetry.py`). Above it,
`stream.py`: the stream over every run's HSPool (one for a single run), the producing side for all of
them, which reaches in through `stream_side` and `job_state`, and the actor's control state (targets,
pauses, eval offers, the stop flag, step records).
Everything here is synchronous except `pull` / `wait_changed`, which only await an asyncio.Event, so
the class is usable (and tested) without Ray.

Job life cycle (`JobState`): pending -> in_flight (on a target) -> buffered (in a bucket) -> leased
(to a drafter) -> acked. A failed target job and a released lease go back to the FRONT of the queue:
the hidden states are recomputed, never kept. Capacity rules: see `holdings.py`.

Jobs arrive as whole epochs (`add_epoch(EpochJobs)`, the run's path): the pool keeps about a byte per
queued job (its state byte and two skip bits: the queue's, the catalog's) and makes a job's JobSpec
only when it issues it. `add_jobs(list[JobSpec])` keeps each JobSpec as given, for tests and benches.
Config values arrive checked (`app/config/schema.py`); the asserts here guard internal invariants.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

from app.config.schema import PoolConfig
from app.data.schedule import EpochJobs
from app.messages import Drained, EndOfStream, ItemMeta, JobSpec, PulledItem
from app.pool.book import JobBook, JobCatalog, JobQueue, JobState
from app.pool.holdings import LeaseRevoked
from app.pool.pull_policy import PullPolicy, make_pull_policy
from app.pool.sides import Drafters, Production, RoundTracker
from app.pool.telemetry import PoolStats

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
        on_change: Callable[[HSPool], None] | None = None,
    ) -> None:
        """`pull_policy`: None = `cfg.pull_policy`. `ranks` (drafters in the group; None = as many
        as pull) and `accum` (train.grad_accum) size a global step for the policy. `queue` builds
        the job queue over the catalog (a test passes a reference queue). `broken_after`: raises in a
        row that make a target broken (supervision.broken_target_raises; see `sides.py`). `on_change`:
        called with the pool on every state change (the stream over the runs' pools wakes its dispatch and
        the other runs with it)."""
        assert num_buckets >= 1, num_buckets
        self.cfg = cfg
        self.num_buckets = num_buckets
        self.policy = make_pull_policy(cfg.pull_policy if pull_policy is None else pull_policy, num_buckets)
        self._clock = clock
        self._event = asyncio.Event()
        self._on_change = on_change
        self._book = JobBook(num_buckets, cfg.capacity, cfg.capacity_bytes, queue, clock, self._wake)
        self._production = Production(self._book, cfg.jobs_in_flight_per_target, broken_after)
        self._drafters = Drafters(self._book, self._production, self.policy, RoundTracker(accum, ranks),
                                  cfg.min_ready, cfg.seed)
        self._leases = self._book.leases  # generations and fences

    # ---- producing side -------------------------------------------------------------------

    def add_jobs(self, jobs: Iterable[JobSpec]) -> int:
        """Append jobs to the queue; restored (already acked) ids are skipped. Returns how many
        were queued."""
        return self._added(self._book.add_jobs(jobs))

    def add_epoch(self, jobs: EpochJobs, bytes_per_token: int = 0) -> int:
        """Queue every job of one epoch, in schedule order, without a JobSpec each (the run's path:
        `jobs` arrives zero-copy from the object store); restored (already acked) jobs are skipped.
        A job's JobSpec is made when it is issued, with est_bytes = `jobs.payload_bytes(index,
        bytes_per_token)` (`RunPlan.bytes_per_token`; 0 = unknown). Returns how many were queued."""
        return self._added(self._book.add_epoch(jobs, bytes_per_token))

    def _added(self, per_bucket: list[int]) -> int:
        self._book.tel.added(per_bucket)
        self.policy.add_jobs(per_bucket)
        self._wake()
        return sum(per_bucket)

    def finish_adding(self) -> None:
        """No more jobs will be added: once all are produced pulls drain, once all are acked EOS."""
        self._book.finished = True
        self._wake()

    def restore_ledger(self, acked_ids: Iterable[int]) -> None:
        """Mark jobs acked by a previous run (from a checkpoint); they are never issued again."""
        self._book.restore(acked_ids)
        self._wake()

    def next_job(self, target_id: int) -> JobSpec | None:
        """The next job for this target, or None if its slots are full or the pool is at capacity."""
        return self._production.next_job(target_id)

    def job_done(self, target_id: int, meta: ItemMeta, payload: Any) -> bool:
        """A target finished a job: buffer the item in its bucket. False for a stale result
        (the job was already failed back to the queue); the caller drops the payload."""
        if not self._production.land(target_id, meta, payload):
            return False
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
        """The production part, for the stream over the runs' pools (`stream.py`): it picks a job with
        `candidate`, checks `fits` and `issue`s it to every run that still needs it."""
        return self._production

    def job_state(self, job_id: int) -> JobState | None:
        return self._book.states.get(job_id)

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
        """Lease one item to the drafter; None means wait (the reservoir is not ready). See `sides.py`."""
        return self._drafters.try_pull(drafter_id)

    async def pull(self, drafter_id: int, generation: int = 0,
                   acks: Iterable[int] = ()) -> PulledItem | EndOfStream | Drained:
        """Ack `acks` (the drafter's previous step: acks ride on its next pull, one call), then wait
        until `try_pull` gives something. Raises LeaseRevoked if this drafter's leases are released
        while it waits (its caller is presumed dead), or if the call comes from an incarnation older
        than the drafter's current `generation(drafter_id)`: Ray still runs a call that a dead
        caller sent, and it must neither ack nor lease an item to nobody."""
        self._leases.see(drafter_id)
        if self._drafters.outdated(drafter_id, generation):
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
                    self._book.tel.waits.add(self._clock() - t0)  # the one pull-wait measurement
                return got
            await self.wait_changed()

    def ack(self, drafter_id: int, job_ids: Iterable[int], generation: int | None = None) -> int:
        """The drafter stepped on these jobs: they join the ledger. Returns how many were acked.
        Acking an acked id is counted (`acked_twice`), never fatal; an id not leased to this
        drafter (e.g. released meanwhile) is ignored and counted in `stale_acks`, and so is every id
        of a call from an incarnation older than `generation(drafter_id)` (fenced like `pull`)."""
        n = self._drafters.ack(drafter_id, list(job_ids), generation)
        self._wake()
        return n

    def payload_lost(self, drafter_id: int, job_id: int, generation: int | None = None) -> bool:
        """The drafter could not read a leased payload (its node died with the object): the job goes
        back to the front of the queue to be recomputed, without rebuilding the drafter group. A call
        from an older incarnation than `generation(drafter_id)` is refused: the job id may now be
        leased to the new incarnation under the same drafter id, and re-queueing it would train it twice."""
        return self._drafters.payload_lost(drafter_id, job_id, generation)

    def release(self, drafter_id: int) -> list[int]:
        """Return all the drafter's unacked jobs to the front of the queue (payloads dropped,
        recomputed later) and fence its waiting pulls."""
        return self._drafters.release(drafter_id)

    def reset_drafters(self) -> list[int]:
        """For a drafter-group rebuild: release every drafter and forget who got end-of-stream,
        so the new group's drafters get it too. Returns the requeued job ids."""
        return self._drafters.reset()

    def set_ranks(self, ranks: int | None) -> None:
        """The drafter group now has `ranks` ranks (a rebuild on fewer GPUs): steps are that big."""
        self._drafters.rounds.ranks = ranks

    def rollback(self, keep_ids: Iterable[int]) -> int:
        """A drafter group rebuilt from a checkpoint whose ledger is `keep_ids`: jobs it never saw go
        back to the front of the queue, jobs it saw are acked whatever their state (the rules:
        `Drafters.rollback`). Returns how many were re-queued."""
        return self._drafters.rollback(keep_ids)

    # ---- queries --------------------------------------------------------------------------

    def ledger(self) -> list[int]:
        """Acked job ids, sorted: saved with each checkpoint."""
        return self._book.ledger.ids()

    def in_flight_count(self, target_id: int) -> int:
        return self._production.in_flight.count(target_id)

    def generation(self, drafter_id: int) -> int:
        """The incarnation a (re)started drafter passes to `pull`; bumped by each release."""
        return self._leases.generation(drafter_id)

    @property
    def pool_bytes(self) -> int:
        """Object-store bytes the pool holds or has reserved: buffered + leased + in flight."""
        return self._book.budget.total

    @property
    def bytes_overshoot(self) -> int:
        return self._book.budget.overshoot

    @property
    def producing_finished(self) -> bool:
        """Every job is produced: nothing pending, nothing in flight, no more coming."""
        return self._production.finished

    @property
    def done(self) -> bool:
        """Every job is acked."""
        return self._drafters.done

    def eos_drafters(self) -> list[int]:
        return sorted(self._drafters.eos)

    def record_step(self, step: int, job_ids: Iterable[int]) -> None:
        """One rank's step report (the jobs it trained): feeds the step-mix measure."""
        catalog = self._book.catalog
        self._book.tel.record_step(step, (catalog.bucket(j) for j in job_ids if j in catalog))

    def drain_pull_waits(self) -> list[float]:
        """Seconds each successful pull waited, since the previous drain (the metrics histogram)."""
        return self._book.tel.waits.drain()

    def stats(self) -> PoolStats:
        """One consistent snapshot: job states, buffer, bytes, in-flight ages, leases, telemetry."""
        now = self._clock()
        by_target = self._production.in_flight.by_target()
        n = self._book.states.counts()
        return PoolStats(
            q_hsb=self._book.buffer.counts(), pool_bytes=self.pool_bytes, capacity_bytes=self.cfg.capacity_bytes,
            capacity_items=self.cfg.capacity, pending=n["pending"], in_flight=n["in_flight"],
            buffered=n["buffered"], leased=n["leased"], acked=n["acked"], total_jobs=len(self._book.states),
            in_flight_by_target=by_target,
            oldest_in_flight_age_s={t: now - min(s for _, s in v) for t, v in by_target.items()},
            leased_by_drafter=self._leases.count_by_drafter(), quarantined=dict(self._production.quarantined),
            broken_targets=sorted(self._production.strikes.broken),
            bytes_overshoot=self.bytes_overshoot, producing_finished=self.producing_finished, done=self.done,
            eos_drafters=self.eos_drafters(), **self._book.tel.fields(now),
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
            self._on_change(self)
