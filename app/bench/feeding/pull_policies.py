"""Pull policies that only benches and tests use (random pulls, a tracing wrapper), and the rank-cost
spread of the pool's dealing at a config's shapes (`python -m app.bench memory` reports it)."""
from __future__ import annotations

import random
from collections.abc import Sequence

from app.pool.pull_policy import BucketOnlyPolicy, PullContext, PullPolicy


class RandomPulls(BucketOnlyPolicy):
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

    def pick(self, ctx: PullContext, bucket: int, costs: Sequence[int], rng: random.Random) -> int | None:
        return self.inner.pick(ctx, bucket, costs, rng)

    def served(self, ctx: PullContext, bucket: int, cost: int) -> None:
        self.inner.served(ctx, bucket, cost)

    def reset(self) -> None:
        self.inner.reset()


def rank_cost_spread(cfg, jobs: int = 1200, seed: int = 0, detail: bool = False):
    """Mean over steady steps (max - min) / mean of the ranks' drafter cost per optimizer step, when
    the pool deals jobs that carry their query rows (JobSpec.cost), simulated (app/bench/feeding/simulate.py)
    at the config's ranks, grad_accum and pool, with each bucket's jobs drawn from
    app/bench/compute/drafter_jobs.py's stated length mix and a bucket mix where the longest bucket dominates
    (conf/tiny.yaml's own: 1, 4, 5, 6, 7, 11 jobs per bucket, scaled to the config's buckets). A
    drafter's time is proportional to its rows. `detail`: also the p90 and max, and the same with
    the dealing off (jobs without costs)."""
    import numpy as np

    from app.bench.compute.drafter_jobs import bucket_job
    from app.bench.feeding.simulate import SimSetup, simulate

    nb = len(cfg.data.bucket_boundaries)
    base = [1, 4, 5, 6, 7, 11]
    mix = [base[round(b * (len(base) - 1) / max(1, nb - 1))] for b in range(nb)]
    samples = [[bucket_job(cfg, b, seed=s).rows for s in range(8)] for b in range(nb)]
    rows = [float(np.mean(x)) for x in samples]
    per_row = 0.2 / max(rows)  # seconds per row: the costliest bucket's job takes 0.2 s
    drafter = [r * per_row for r in rows]
    mean = sum(m * c for m, c in zip(mix, drafter)) / sum(mix)
    W, G = cfg.topology.num_drafters, cfg.train.grad_accum
    target = [cfg.topology.num_targets * mean / (W * 1.1)] * nb
    cv = max(float(np.std(x) / np.mean(x)) for x in samples)
    out = {}
    for name, known in (("dealt", rows), ("blind", ())):
        setup = SimSetup(mix, jobs, drafter, target, ranks=W, accum=G, targets=cfg.topology.num_targets,
                         jitter=max(0.05, min(0.3, cv * 1.7)), pool=cfg.pool, seed=seed, rows=known)
        sp = sorted(simulate(setup).rank_cost_spreads()[3:-3])
        out[name] = (float(np.mean(sp)), sp[int(0.9 * len(sp))], sp[-1]) if sp else (float("nan"),) * 3
    return out if detail else out["dealt"][0]
