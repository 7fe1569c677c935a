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

    def put(self, item: Item) -> None:
        self._buckets[item.meta.bucket].append(item)
        self._count += 1

    def take(self, bucket: int, rng: random.Random) -> Item:
        items = self._buckets[bucket]
        assert items, f"take from empty bucket {bucket}"
        k = rng.randrange(len(items))
        items[k], items[-1] = items[-1], items[k]  # swap-remove keeps it O(1)
        self._count -= 1
        return items.pop()

    def counts(self) -> list[int]:
        """Items per bucket: the q_hsb vector."""
        return [len(b) for b in self._buckets]

    def nonempty(self) -> list[int]:
        return [b for b, items in enumerate(self._buckets) if items]

    def __len__(self) -> int:
        return self._count
