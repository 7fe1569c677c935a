"""What the pool holds, and its bytes: produced items per length bucket (`BucketBuffer`; the pool never
reads a payload), the items lent to drafters until they ack them (`LeaseTable`, with the generation
fences that keep a dead drafter's calls harmless) and the capacity budget over both (`Budget`).

Capacity, in items and bytes:
- items: buffered + in_flight < capacity to issue one more. Leased items do not count: they are
  bounded by the drafters' grad_accum and prefetch, and counting them could starve a drafter that
  holds half a step of leases while it waits for the rest (it cannot ack before the step).
- bytes: buffered + leased + in-flight reservations <= capacity_bytes. Leased payloads are still
  pool-owned object-store memory until acked, so they count. An in-flight job reserves
  max(JobSpec.est_bytes, largest payload seen in its bucket); the reservation is replaced by the
  real ItemMeta.nbytes when the job lands. The cap holds as long as estimates are upper bounds; a
  payload larger than its reservation is counted in `overshoot`.

Leases: a drafter's generation is bumped each time its leases are released (it died or the group is
being rebuilt): a pull sent by an older incarnation, or one still waiting when the release happened,
is refused (LeaseRevoked) and takes nothing. A group generation, bumped on every group reset, also
fences drafters that held no lease.

The cluster's object store holds more than the pool's payloads: `StoreNeed` adds the dataset and
schedule and the live evaluations' weight offers, which `check_object_store` compares with the store
before a run starts.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from app.config.checks import leased_jobs
from app.config.errors import ConfigError
from app.config.schema import Config
from app.messages import ItemMeta, JobSpec


@dataclass
class Item:
    job: JobSpec
    meta: ItemMeta
    payload: Any  # opaque: the pool-owned ObjectRef in the actor


class BucketBuffer:
    """Buffered items per bucket; `take` removes a uniformly random item of a bucket in O(1)."""

    def __init__(self, num_buckets: int) -> None:
        self._buckets: list[list[Item]] = [[] for _ in range(num_buckets)]
        self._count = 0
        self._cost_sum = [0] * num_buckets  # drafter cost (JobSpec.cost) of the buffered items
        self._seen = [[0, 0] for _ in range(num_buckets)]  # (cost sum, items) of every item ever put

    def put(self, item: Item) -> None:
        b = item.meta.bucket
        self._buckets[b].append(item)
        self._count += 1
        self._cost_sum[b] += item.job.cost
        self._seen[b][0] += item.job.cost
        self._seen[b][1] += 1

    def take(self, bucket: int, rng: random.Random, index: int | None = None) -> Item:
        """A uniformly random item of the bucket, or the one at `index` of `costs(bucket)`."""
        items = self._buckets[bucket]
        assert items, f"take from empty bucket {bucket}"
        k = rng.randrange(len(items)) if index is None else index
        items[k], items[-1] = items[-1], items[k]  # swap-remove keeps it O(1)
        self._count -= 1
        item = items.pop()
        self._cost_sum[bucket] -= item.job.cost
        return item

    def remove(self, job_id: int, bucket: int) -> Item | None:
        """Take out the item of this job, if buffered (a rollback acks it: the checkpoint trained it)."""
        items = self._buckets[bucket]
        k = next((i for i, it in enumerate(items) if it.meta.job_id == job_id), None)
        return None if k is None else self.take(bucket, random.Random(), k)

    def counts(self) -> list[int]:
        """Items per bucket: the q_hsb vector."""
        return [len(b) for b in self._buckets]

    def costs(self, bucket: int) -> list[int]:
        """The drafter cost of each buffered item of the bucket (indices for `take`)."""
        return [it.job.cost for it in self._buckets[bucket]]

    def mean_costs(self) -> list[float]:
        """Expected drafter cost of an item of each bucket: the buffered items' mean, else the mean of
        every item the bucket has held, else 0 (unknown)."""
        out = []
        for b, items in enumerate(self._buckets):
            if items:
                out.append(self._cost_sum[b] / len(items))
            else:
                total, n = self._seen[b]
                out.append(total / n if n else 0.0)
        return out

    def nonempty(self) -> list[int]:
        return [b for b, items in enumerate(self._buckets) if items]

    def __len__(self) -> int:
        return self._count


class LeaseRevoked(RuntimeError):
    """A pull that was waiting when its drafter's leases were released (the drafter died or the
    group is being rebuilt). It takes nothing, so no item leaks to a dead drafter."""


@dataclass
class Lease:
    item: Item
    drafter_id: int
    since: float


class LeaseTable:
    """job id -> Lease; per-drafter generations; every drafter id ever seen."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._generation: dict[int, int] = {}
        self.group_generation = 0
        self._seen: set[int] = set()

    # ---- leases ---------------------------------------------------------------------------

    def lease(self, item: Item, drafter_id: int, now: float) -> None:
        jid = item.meta.job_id
        assert jid not in self._leases, f"job {jid} leased twice"
        self._leases[jid] = Lease(item, drafter_id, now)

    def holder(self, job_id: int) -> int | None:
        lease = self._leases.get(job_id)
        return None if lease is None else lease.drafter_id

    def pop(self, job_id: int) -> Lease:
        return self._leases.pop(job_id)

    def of(self, drafter_id: int) -> list[Lease]:
        """The drafter's leases, oldest first."""
        return sorted((ls for ls in self._leases.values() if ls.drafter_id == drafter_id), key=lambda ls: ls.since)

    def count_by_drafter(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for ls in self._leases.values():
            out[ls.drafter_id] = out.get(ls.drafter_id, 0) + 1
        return out

    def __len__(self) -> int:
        return len(self._leases)

    # ---- drafters and fences --------------------------------------------------------------

    def see(self, drafter_id: int) -> None:
        self._seen.add(drafter_id)

    def drafters(self) -> list[int]:
        """Every drafter that ever pulled, holds a lease or was released."""
        return sorted({ls.drafter_id for ls in self._leases.values()} | set(self._generation) | self._seen)

    def generation(self, drafter_id: int) -> int:
        return self._generation.get(drafter_id, 0)

    def bump(self, drafter_id: int) -> None:
        self._generation[drafter_id] = self.generation(drafter_id) + 1

    def bump_group(self) -> None:
        self.group_generation += 1

    def fence(self, drafter_id: int) -> tuple[int, int]:
        """Changes whenever this drafter's waiting pulls must be refused."""
        return self.group_generation, self.generation(drafter_id)


class Budget:
    """The pool's capacity accounting in items and bytes (buffered, leased, reserved for jobs in flight)."""

    def __init__(self, capacity_items: int, capacity_bytes: int, num_buckets: int) -> None:
        self.capacity_items = capacity_items
        self.capacity_bytes = capacity_bytes
        self.buffered = 0  # bytes
        self.leased = 0
        self.reserved = 0
        self.overshoot = 0  # payloads larger than their reservation
        self._max_seen = [0] * num_buckets

    @property
    def total(self) -> int:
        """Object-store bytes held or reserved: buffered + leased + in flight."""
        return self.buffered + self.leased + self.reserved

    def reservation(self, job: JobSpec) -> int:
        # Never above the cap: a bucket that once landed a payload larger than the whole budget
        # would otherwise never fit again, and every pull of the run would answer Drained forever.
        return min(self.capacity_bytes, max(job.est_bytes, self._max_seen[job.bucket]))

    def fits(self, items_held: int, reserve: int) -> bool:
        """Whether one more job (reserving `reserve` bytes) may be issued with `items_held`
        buffered + in flight."""
        return items_held < self.capacity_items and self.total + reserve <= self.capacity_bytes

    def reserve(self, nbytes: int) -> None:
        self.reserved += nbytes

    def unreserve(self, nbytes: int) -> None:
        self.reserved -= nbytes
        assert self.reserved >= 0

    def land(self, reserved: int, nbytes: int, bucket: int) -> None:
        """A job landed: its reservation becomes its real size."""
        self.unreserve(reserved)
        if nbytes > reserved:
            self.overshoot += 1
        self._max_seen[bucket] = max(self._max_seen[bucket], nbytes)
        self.buffered += nbytes

    def unbuffer(self, nbytes: int) -> None:
        """A buffered item dropped unleased (a rollback acked its job)."""
        self.buffered -= nbytes
        assert self.buffered >= 0

    def lease(self, nbytes: int) -> None:
        self.buffered -= nbytes
        self.leased += nbytes
        assert self.buffered >= 0

    def unlease(self, nbytes: int) -> None:
        """An acked, released or lost lease frees its bytes."""
        self.leased -= nbytes
        assert self.leased >= 0


# ---- the whole object store, not just the pool ---------------------------------------------------------

# Live evaluation copies of rank 0's weights at once: the pool's newest offer, the one taken and waiting
# for a target (app/run/evaluate/schedule.py EvalSchedule.pending) and the one being evaluated (.running).
EVAL_COPIES = 3


@dataclass(frozen=True)
class StoreNeed:
    """The most a run holds in the object store at once, by part: the pool's payloads (its byte budget,
    or the items bound when smaller), the dataset and the schedule the supervisor puts once (every target
    reads them from there), and the live evaluations' weight offers (float32 state dicts)."""

    payloads: int
    dataset: int = 0
    eval_offers: int = 0

    @property
    def total(self) -> int:
        return self.payloads + self.dataset + self.eval_offers

    def parts(self) -> str:
        """The parts that are not zero, for the one-line refusal."""
        gib = 2**30
        named = [(self.dataset, "the dataset and schedule"),
                 (self.eval_offers, f"eval offers ({EVAL_COPIES} copies of the drafter's float32 weights)")]
        return "".join(f" + {n / gib:.1f} GiB of {what}" for n, what in named if n)


def eval_offer_bytes(weight_bytes: int, evaluating: bool) -> int:
    """Object-store bytes of live evaluation offers: none when the run does not evaluate."""
    return EVAL_COPIES * weight_bytes if evaluating else 0


def payload_bound(cfg: Config, job_bytes: int) -> int:
    """The most payload bytes unconsumed at once: the byte budget, or the items bound when smaller (buffered
    and in flight up to pool.capacity, plus each drafter's leases)."""
    return min(cfg.pool.capacity_bytes, (cfg.pool.capacity + leased_jobs(cfg)) * job_bytes)


def payloads_in_store(cfg: Config, job_bytes: int) -> int:
    """Payload bytes the object store holds: all of them, or none with `pool.transport=nixl` (the targets
    hold them in their own memory, `app/config/checks.py` check_target_memory; the store keeps only the
    small `NixlPayload` per job)."""
    return 0 if cfg.pool.transport == "nixl" else payload_bound(cfg, job_bytes)


def check_object_store(cfg: Config, job_bytes: int, object_store_bytes: float, dataset_bytes: int = 0,
                       eval_bytes: int = 0) -> None:
    """What the run holds in the object store must fit it, or Ray spills hidden states to disk and
    throughput collapses. `pool.capacity_bytes` covers buffered, in-flight and leased payloads
    (Budget above); `pool.capacity` counts buffered and in-flight items only, and each drafter
    leases at most grad_accum + 1 (its step plus one prefetched) on top, so the most the pool can hold
    is the smaller of the two bounds. On top: the dataset and schedule (`dataset_bytes`, put once) and
    the live evaluations' weight offers (`eval_bytes`, `eval_offer_bytes`)."""
    leased_items = leased_jobs(cfg)
    need = StoreNeed(payloads_in_store(cfg, job_bytes), dataset_bytes, eval_bytes)
    if object_store_bytes and need.total > object_store_bytes:
        gib = 2**30
        raise ConfigError(
            f"pool.capacity_bytes={cfg.pool.capacity_bytes} lets the pool hold {need.payloads / gib:.1f} GiB of hidden "
            f"states (pool.capacity={cfg.pool.capacity} + {leased_items} leased jobs of up to {job_bytes / gib:.2f} GiB)"
            f"{need.parts()} but the cluster's object store holds {object_store_bytes / gib:.1f} GiB and would spill; "
            "lower pool.capacity_bytes or pool.capacity, or start Ray with a larger --object-store-memory"
        )
