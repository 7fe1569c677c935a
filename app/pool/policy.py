"""The hidden-state pool's policy: a plain class, no Ray.

`HSPool` holds the job queue shared by all targets, the produced items per length bucket, the
leases of pulled items and the ledger of acked jobs. `actors/hs_pool.py` wraps it in an async
actor; everything here is synchronous except `pull` / `wait_changed`, which only await an
asyncio.Event, so the class is usable (and tested) without Ray.

Job life cycle: pending -> in_flight (on a target) -> buffered (in a bucket) -> leased (to a
drafter) -> acked. A failed target job and a released lease go back to the FRONT of the queue: the
hidden states are recomputed, never kept.

Capacity accounting (why it is split this way):
- items: buffered + in_flight <= capacity. Leased items do not count: they are bounded by the
  drafters' grad_accum and prefetch, and counting them could starve a drafter that holds half a
  step of leases while it waits for the rest (it cannot ack before the step).
- bytes: buffered + leased + in-flight reservations <= capacity_bytes. Leased payloads are still
  pool-owned object-store memory until acked, so they count. An in-flight job reserves
  max(JobSpec.est_bytes, largest payload seen in its bucket); the reservation is replaced by the
  real ItemMeta.nbytes when the job lands. The cap holds as long as estimates are upper bounds;
  a payload larger than its reservation is counted in `bytes_overshoot`.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from app.config.schema import PoolConfig
from app.messages import Drained, EndOfStream, ItemMeta, JobSpec, PulledItem
from app.pool.stats import PoolStats, WaitStats

PULL_POLICIES = ("fair", "random")


class LeaseRevoked(RuntimeError):
    """A pull that was waiting when its drafter's leases were released (the drafter died or the
    group is being rebuilt). It takes nothing, so no item leaks to a dead drafter."""


@dataclass
class _InFlight:
    job: JobSpec
    target_id: int
    start: float
    reserved_bytes: int


@dataclass
class _Item:
    job: JobSpec
    meta: ItemMeta
    payload: Any  # opaque: the pool-owned ObjectRef in the actor


@dataclass
class _Lease:
    item: _Item
    drafter_id: int
    since: float


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
        pull_policy: str = "fair",
        clock: Callable[[], float] = time.monotonic,
        trace_pulls: bool = False,
    ) -> None:
        _validate(cfg, num_buckets, pull_policy)
        self.cfg = cfg
        self.num_buckets = num_buckets
        self.pull_policy = pull_policy
        self._clock = clock
        self._rng = random.Random(cfg.seed)
        self._queue: deque[JobSpec] = deque()
        self._known: set[int] = set()  # every job id ever added or restored
        self._in_flight: dict[int, _InFlight] = {}
        self._buckets: list[list[_Item]] = [[] for _ in range(num_buckets)]
        self._leases: dict[int, _Lease] = {}
        self._acked: set[int] = set()
        self._adding_finished = False
        self._cursor: dict[int, int] = {}  # drafter -> last bucket served (fair policy)
        self._generation: dict[int, int] = {}  # drafter -> bumped on release (fences old pulls)
        # Bumped on every group reset: fences waiting pulls of drafters that held no lease too.
        self._group_generation = 0
        self._specs: dict[int, JobSpec] = {}  # every job added, for re-queueing on rollback
        self._eos_drafters: set[int] = set()
        self._seen_drafters: set[int] = set()  # every drafter id that ever pulled
        self._max_seen_bytes = [0] * num_buckets
        self._buffered_bytes = 0
        self._leased_bytes = 0
        self._reserved_bytes = 0
        self._served = [0] * num_buckets
        self._produced = [0] * num_buckets
        self._targets: dict[int, _TargetTally] = {}
        self._waits = WaitStats()
        self.acked_twice = 0
        self.stale_results = 0
        self.stale_acks = 0
        self.lost_payloads = 0
        self.bytes_overshoot = 0
        self._event = asyncio.Event()
        # (drafter, bucket, bitmask of non-empty buckets before the pull) per pull; for benches.
        self.pull_trace: list[tuple[int, int, int]] | None = [] if trace_pulls else None

    # ---- producing side -------------------------------------------------------------------

    def add_jobs(self, jobs: Iterable[JobSpec]) -> int:
        """Append jobs to the queue; restored (already acked) ids are skipped. Returns how many
        were queued."""
        if self._adding_finished:
            raise ValueError("add_jobs after finish_adding: add every job of the run first")
        added = 0
        for job in jobs:
            if job.job_id in self._acked:
                continue
            self._check_job(job)
            self._known.add(job.job_id)
            self._specs[job.job_id] = job
            self._queue.append(job)
            added += 1
        self._wake()
        return added

    def finish_adding(self) -> None:
        """No more jobs will be added: once all are produced pulls drain, once all are acked EOS."""
        self._adding_finished = True
        self._wake()

    def restore_ledger(self, acked_ids: Iterable[int]) -> None:
        """Mark jobs acked by a previous run (from a checkpoint); they are never issued again."""
        ids = set(acked_ids)
        self._acked |= ids
        self._known |= ids
        self._queue = deque(j for j in self._queue if j.job_id not in ids)
        self._wake()

    def next_job(self, target_id: int) -> JobSpec | None:
        """The next job for this target, or None if its slots are full or the pool is at capacity."""
        if not self._queue or self.in_flight_count(target_id) >= self.cfg.jobs_in_flight_per_target:
            return None
        job = self._queue[0]
        reserve = max(job.est_bytes, self._max_seen_bytes[job.bucket])
        if not self._fits(reserve):
            return None
        self._queue.popleft()
        self._in_flight[job.job_id] = _InFlight(job, target_id, self._clock(), reserve)
        self._reserved_bytes += reserve
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
        del self._in_flight[meta.job_id]
        self._reserved_bytes -= fl.reserved_bytes
        if meta.nbytes > fl.reserved_bytes:
            self.bytes_overshoot += 1
        self._max_seen_bytes[meta.bucket] = max(self._max_seen_bytes[meta.bucket], meta.nbytes)
        self._buckets[meta.bucket].append(_Item(fl.job, meta, payload))
        self._buffered_bytes += meta.nbytes
        self._produced[meta.bucket] += 1
        tally = self._targets.setdefault(target_id, _TargetTally())
        tally.done += 1
        tally.tokens += meta.num_tokens
        tally.forward_s += meta.forward_s
        self._wake()
        return True

    def job_failed(self, target_id: int, job_id: int) -> bool:
        """A target job failed: it goes back to the front of the queue."""
        fl = self._in_flight.get(job_id)
        if fl is None or fl.target_id != target_id:
            return False
        self._requeue_in_flight([job_id])
        return True

    def target_lost(self, target_id: int) -> list[int]:
        """A target died: all its in-flight jobs go back to the front of the queue."""
        ids = [jid for jid, fl in self._in_flight.items() if fl.target_id == target_id]
        self._requeue_in_flight(ids)
        return ids

    # ---- consuming side -------------------------------------------------------------------

    def try_pull(self, drafter_id: int) -> PulledItem | EndOfStream | Drained | None:
        """Lease one item to the drafter; None means wait (the reservoir is not ready)."""
        if self.done:
            self._eos_drafters.add(drafter_id)
            return EndOfStream()
        buffered = self.buffered_count
        if buffered == 0:
            # Also drain when leases hold the byte budget and nothing is in flight: the rank must
            # step with what it has and ack, or its own leases would block the next job forever.
            return Drained() if (self.producing_finished or self._stalled()) else None
        if buffered < self.cfg.min_ready and not (self.producing_finished or self._stalled()):
            return None
        if self.pull_trace is not None:
            nonempty = sum(1 << b for b, items in enumerate(self._buckets) if items)
        bucket = self._choose_bucket(drafter_id)
        if self.pull_trace is not None:
            self.pull_trace.append((drafter_id, bucket, nonempty))
        items = self._buckets[bucket]
        # A uniformly random item within the bucket; swap-remove keeps it O(1).
        k = self._rng.randrange(len(items))
        items[k], items[-1] = items[-1], items[k]
        item = items.pop()
        self._buffered_bytes -= item.meta.nbytes
        self._leased_bytes += item.meta.nbytes
        self._leases[item.meta.job_id] = _Lease(item, drafter_id, self._clock())
        self._served[bucket] += 1
        self._wake()  # a freed item slot may let a job be issued
        return PulledItem(meta=item.meta, payload_ref=item.payload)

    async def pull(self, drafter_id: int, generation: int = 0) -> PulledItem | EndOfStream | Drained:
        """Wait until `try_pull` gives something. Raises LeaseRevoked if this drafter's leases
        are released while it waits (its caller is presumed dead), or if the call comes from an
        incarnation older than the drafter's current `generation(drafter_id)`: Ray still runs a
        call that a dead caller sent, and it must not lease an item to nobody."""
        self._seen_drafters.add(drafter_id)
        if generation < self._generation.get(drafter_id, 0):
            raise LeaseRevoked(f"drafter {drafter_id} generation {generation} was released")
        fence = self._fence(drafter_id)
        t0 = self._clock()
        while True:
            if self._fence(drafter_id) != fence:
                raise LeaseRevoked(f"drafter {drafter_id} was released while its pull waited")
            got = self.try_pull(drafter_id)
            if got is not None:
                if isinstance(got, PulledItem):
                    self._waits.add(self._clock() - t0)
                return got
            await self.wait_changed()

    def ack(self, drafter_id: int, job_ids: Iterable[int]) -> int:
        """The drafter stepped on these jobs: they join the ledger. Returns how many were acked.
        Acking an acked id is counted (`acked_twice`), never fatal; an id not leased to this
        drafter (e.g. released meanwhile) is ignored and counted in `stale_acks`."""
        n = 0
        for jid in job_ids:
            lease = self._leases.get(jid)
            if jid in self._acked:
                self.acked_twice += 1
            elif lease is None or lease.drafter_id != drafter_id:
                self.stale_acks += 1
            else:
                del self._leases[jid]
                self._leased_bytes -= lease.item.meta.nbytes
                self._acked.add(jid)
                n += 1
        self._wake()
        return n

    def payload_lost(self, drafter_id: int, job_id: int) -> bool:
        """The drafter could not read a leased payload (its node died with the object): the job goes
        back to the front of the queue to be recomputed, without rebuilding the drafter group."""
        lease = self._leases.get(job_id)
        if lease is None or lease.drafter_id != drafter_id:
            return False
        del self._leases[job_id]
        self._leased_bytes -= lease.item.meta.nbytes
        self._queue.appendleft(lease.item.job)
        self.lost_payloads += 1
        self._wake()
        return True

    def release(self, drafter_id: int) -> list[int]:
        """Return all the drafter's unacked jobs to the front of the queue (payloads dropped,
        recomputed later) and fence its waiting pulls."""
        mine = sorted(
            (ls for ls in self._leases.values() if ls.drafter_id == drafter_id), key=lambda ls: ls.since
        )
        for ls in reversed(mine):  # appendleft in reverse keeps the original order at the front
            del self._leases[ls.item.meta.job_id]
            self._leased_bytes -= ls.item.meta.nbytes
            self._queue.appendleft(ls.item.job)
        self._generation[drafter_id] = self._generation.get(drafter_id, 0) + 1
        self._wake()
        return [ls.item.meta.job_id for ls in mine]

    def reset_drafters(self) -> list[int]:
        """For a drafter-group rebuild: release every drafter and forget who got end-of-stream,
        so the new group's drafters get it too. Returns the requeued job ids."""
        ids: list[int] = []
        for d in sorted({ls.drafter_id for ls in self._leases.values()} | set(self._generation) | self._seen_drafters):
            ids += self.release(d)
        self._group_generation += 1
        self._eos_drafters.clear()
        self._cursor.clear()
        self._wake()
        return ids

    def rollback(self, keep_ids: Iterable[int]) -> int:
        """A drafter group rebuilt from a checkpoint whose ledger is `keep_ids`: every lease and every
        job acked after that checkpoint goes back to the front of the queue (in schedule order),
        since the restored weights never saw them. Returns how many were re-queued."""
        n = len(self.reset_drafters())
        keep = set(keep_ids)
        undo = sorted((self._specs[j] for j in self._acked - keep if j in self._specs), key=lambda job: job.job_id)
        for job in reversed(undo):  # appendleft in reverse keeps schedule order at the front
            self._acked.discard(job.job_id)
            self._queue.appendleft(job)
        self._wake()
        return n + len(undo)

    # ---- queries --------------------------------------------------------------------------

    def ledger(self) -> list[int]:
        """Acked job ids, sorted: saved with each checkpoint."""
        return sorted(self._acked)

    def in_flight_count(self, target_id: int) -> int:
        return sum(1 for fl in self._in_flight.values() if fl.target_id == target_id)

    @property
    def buffered_count(self) -> int:
        return sum(len(b) for b in self._buckets)

    @property
    def pool_bytes(self) -> int:
        """Object-store bytes the pool holds or has reserved: buffered + leased + in flight."""
        return self._buffered_bytes + self._leased_bytes + self._reserved_bytes

    @property
    def producing_finished(self) -> bool:
        """Every job is produced: nothing pending, nothing in flight, no more coming."""
        return self._adding_finished and not self._queue and not self._in_flight

    @property
    def done(self) -> bool:
        """Every job is acked."""
        return self.producing_finished and self.buffered_count == 0 and not self._leases

    def eos_drafters(self) -> list[int]:
        return sorted(self._eos_drafters)

    def stats(self) -> PoolStats:
        now = self._clock()
        by_target: dict[int, list[tuple[int, float]]] = {}
        for jid, fl in self._in_flight.items():
            by_target.setdefault(fl.target_id, []).append((jid, fl.start))
        leased_by: dict[int, int] = {}
        for ls in self._leases.values():
            leased_by[ls.drafter_id] = leased_by.get(ls.drafter_id, 0) + 1
        return PoolStats(
            q_hsb=[len(b) for b in self._buckets],
            pool_bytes=self.pool_bytes,
            capacity_bytes=self.cfg.capacity_bytes,
            capacity_items=self.cfg.capacity,
            pending=len(self._queue),
            in_flight=len(self._in_flight),
            buffered=self.buffered_count,
            leased=len(self._leases),
            acked=len(self._acked),
            total_jobs=len(self._known),
            pull_waits=self._waits.snapshot(),
            served_per_bucket=list(self._served),
            produced_per_bucket=list(self._produced),
            in_flight_by_target=by_target,
            oldest_in_flight_age_s={t: now - min(s for _, s in v) for t, v in by_target.items()},
            done_by_target={t: c.done for t, c in self._targets.items()},
            tokens_by_target={t: c.tokens for t, c in self._targets.items()},
            forward_s_by_target={t: c.forward_s for t, c in self._targets.items()},
            leased_by_drafter=leased_by,
            acked_twice=self.acked_twice,
            stale_results=self.stale_results,
            stale_acks=self.stale_acks,
            lost_payloads=self.lost_payloads,
            bytes_overshoot=self.bytes_overshoot,
            producing_finished=self.producing_finished,
            done=self.done,
            eos_drafters=self.eos_drafters(),
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

    def _fits(self, reserve: int) -> bool:
        items = self.buffered_count + len(self._in_flight)
        return items < self.cfg.capacity and self.pool_bytes + reserve <= self.cfg.capacity_bytes

    def _stalled(self) -> bool:
        """Nothing in flight and the next job does not fit: waiting for min_ready would deadlock
        (leases hold the bytes, and they are acked only after pulls succeed), so pulls drain."""
        if self._in_flight or not self._queue:
            return False
        job = self._queue[0]
        return not self._fits(max(job.est_bytes, self._max_seen_bytes[job.bucket]))

    def _choose_bucket(self, drafter_id: int) -> int:
        if self.pull_policy == "random":  # uniform over items: dominant buckets dominate
            k = self._rng.randrange(self.buffered_count)
            for b, items in enumerate(self._buckets):
                if k < len(items):
                    return b
                k -= len(items)
            raise AssertionError("unreachable: k < buffered_count")
        # Fair: the next non-empty bucket after the last one this drafter got.
        last = self._cursor.get(drafter_id, -1)
        for step in range(1, self.num_buckets + 1):
            b = (last + step) % self.num_buckets
            if self._buckets[b]:
                self._cursor[drafter_id] = b
                return b
        raise AssertionError("unreachable: buffered_count > 0")

    def _requeue_in_flight(self, job_ids: list[int]) -> None:
        fls = sorted((self._in_flight.pop(j) for j in job_ids), key=lambda fl: fl.start)
        for fl in reversed(fls):
            self._reserved_bytes -= fl.reserved_bytes
            self._queue.appendleft(fl.job)
        self._wake()

    def generation(self, drafter_id: int) -> int:
        """The incarnation a (re)started drafter passes to `pull`; bumped by each release."""
        return self._generation.get(drafter_id, 0)

    def _fence(self, drafter_id: int) -> tuple[int, int]:
        return self._group_generation, self._generation.get(drafter_id, 0)

    def _check_job(self, job: JobSpec) -> None:
        if job.job_id in self._known:
            raise ValueError(f"job {job.job_id} added twice: job ids must be unique across epochs")
        if not 0 <= job.bucket < self.num_buckets:
            raise ValueError(
                f"job {job.job_id} has bucket {job.bucket}, outside 0..{self.num_buckets - 1}: "
                "build the pool with num_buckets = len(data.bucket_boundaries)"
            )
        if job.est_bytes > self.cfg.capacity_bytes:
            raise ValueError(
                f"job {job.job_id} needs ~{job.est_bytes} bytes, more than pool.capacity_bytes="
                f"{self.cfg.capacity_bytes}: raise pool.capacity_bytes or lower data.tokens_per_job"
            )


def _validate(cfg: PoolConfig, num_buckets: int, pull_policy: str) -> None:
    if num_buckets < 1:
        raise ValueError(f"num_buckets={num_buckets}: need at least one length bucket")
    if cfg.capacity < 1:
        raise ValueError(f"pool.capacity={cfg.capacity}: must be >= 1 item")
    if cfg.capacity_bytes < 1:
        raise ValueError(f"pool.capacity_bytes={cfg.capacity_bytes}: must be > 0")
    if not 0 <= cfg.min_ready <= cfg.capacity:
        raise ValueError(
            f"pool.min_ready={cfg.min_ready} must be in 0..pool.capacity ({cfg.capacity}): "
            "lower pool.min_ready or raise pool.capacity"
        )
    if cfg.jobs_in_flight_per_target < 1:
        raise ValueError(f"pool.jobs_in_flight_per_target={cfg.jobs_in_flight_per_target}: must be >= 1")
    if pull_policy not in PULL_POLICIES:
        raise ValueError(f"pull_policy={pull_policy!r}: use one of {PULL_POLICIES}")
