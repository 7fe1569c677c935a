"""Pull policies that only benches and tests use: random pulls, and a tracing wrapper."""
from __future__ import annotations

import random
from collections.abc import Sequence

from app.pool.pull_policy import PullContext, PullPolicy


class RandomPulls:
    """Uniform over buffered items: a bucket is picked in proportion to what it holds, so the
    dominant bucket dominates the pulls (the seed pipeline's behaviour)."""

    name = "random"

    def __init__(self, num_buckets: int) -> None:
        self.num_buckets = num_buckets

    def add_jobs(self, per_bucket: Sequence[int]) -> None:
        pass

    def choose(self, ctx: PullContext, rng: random.Random) -> int:
        k = rng.randrange(sum(ctx.counts))
        for b, n in enumerate(ctx.counts):
            if k < n:
                return b
            k -= n
        raise AssertionError("choose called with every bucket empty")

    def reset(self) -> None:
        pass


class TracedPulls:
    """Wraps a policy and records (drafter, bucket, bitmask of non-empty buckets before the pull)."""

    def __init__(self, inner: PullPolicy) -> None:
        self.inner = inner
        self.name = f"traced-{inner.name}"
        self.trace: list[tuple[int, int, int]] = []

    def add_jobs(self, per_bucket: Sequence[int]) -> None:
        self.inner.add_jobs(per_bucket)

    def choose(self, ctx: PullContext, rng: random.Random) -> int | None:
        b = self.inner.choose(ctx, rng)
        if b is not None:
            self.trace.append((ctx.drafter_id, b, sum(1 << i for i, n in enumerate(ctx.counts) if n)))
        return b

    def reset(self) -> None:
        self.inner.reset()
