"""Produced items, one list per length bucket; the pool never reads a payload."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

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
