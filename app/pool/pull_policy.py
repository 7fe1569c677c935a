"""Which bucket the next pull takes from (and, when dealing for cost, which item; else the pool takes
a uniformly random item of the bucket, seeded).

`stratified` (the default): each bucket is served at the rate the schedule produces it, and every
global step (all ranks' micro-batches of one optimizer step) is as close to a stratified sample of
the schedule's bucket shares as the items on hand allow. Per step ("round", see sides.py) it owes
each bucket step_items x share items, carries what it could not serve into the next steps (a
deficit, bounded by one step's worth), and apportions the round's items by what is owed (largest
remainder); each pull takes, among the non-empty buckets this round still owes, the one with the
most items buffered (so the buffer's largest bucket stays small), else the most owed one on hand.
When jobs carry their drafter cost (JobSpec.cost, query rows) it also deals: of the buckets the step
owes, a rank takes the one (and of that bucket the item) after which the rest of the step's quota,
dealt largest first to the least-loaded rank, leaves the ranks' step costs closest, so ranks do not
wait for each other at the all-reduce; the step's composition stays its quota. Once production is over it
stratifies what is left (the buffer's own mix) and splits it into equal steps, so the last steps
still mix.

`round_robin`: per drafter, the next non-empty bucket after the last one it got. Every non-empty
bucket is served at the same rate whatever its share, so the dominant bucket piles up in the buffer
while short buckets are served the moment they land (kept for comparison).
"""
from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class PullContext:
    """What a policy sees for one pull."""

    drafter_id: int
    round: int  # the drafter's step as the pool counts it (sides.py)
    counts: Sequence[int]  # buffered items per bucket; at least one is non-empty
    step_items: int  # items in one global step: ranks x grad_accum
    producing_finished: bool  # nothing more will land (until something is re-queued)
    open_slots: Mapping[int, int] = field(default_factory=dict)  # round -> pulls its ranks may still make
    ranks_known: bool = False  # step_items counts the group's real ranks (else only who pulled so far)
    costs: Sequence[float] = ()  # expected drafter cost (query rows) of an item of each bucket; 0 = unknown
    round_slots: Mapping[int, int] = field(default_factory=dict)  # rank -> pulls it will still make this round


class PullPolicy(Protocol):
    name: str

    def add_jobs(self, per_bucket: Sequence[int]) -> None:
        """Jobs were scheduled, `per_bucket[b]` of bucket b: the shares to serve at."""

    def choose(self, ctx: PullContext, rng: random.Random) -> int | None:
        """A bucket with ctx.counts[bucket] > 0, or None to end the drafter's step early (it gets
        `Drained`, steps with what it holds and pulls again)."""

    def pick(self, ctx: PullContext, bucket: int, costs: Sequence[int], rng: random.Random) -> int | None:
        """Which item of the chosen bucket (an index into `costs`), or None for a random one."""

    def served(self, ctx: PullContext, bucket: int, cost: int) -> None:
        """The item the pull took from `bucket` costs `cost` (JobSpec.cost)."""

    def reset(self) -> None:
        """The drafter group is rebuilt: forget per-drafter and per-step state."""


class BucketOnlyPolicy:
    """Base of the policies that only choose a bucket: a random item within it, no per-step state."""

    def pick(self, ctx: PullContext, bucket: int, costs: Sequence[int], rng: random.Random) -> None:
        return None

    def served(self, ctx: PullContext, bucket: int, cost: int) -> None:
        pass

    def reset(self) -> None:
        pass


class RoundRobin(BucketOnlyPolicy):
    """Per-drafter round-robin over the non-empty buckets (the first wave's policy, kept to compare)."""

    name = "round_robin"

    def __init__(self, num_buckets: int) -> None:
        self.num_buckets = num_buckets
        self._cursor: dict[int, int] = {}  # drafter -> last bucket served

    def add_jobs(self, per_bucket: Sequence[int]) -> None:
        pass

    def choose(self, ctx: PullContext, rng: random.Random) -> int:
        last = self._cursor.get(ctx.drafter_id, -1)
        for step in range(1, self.num_buckets + 1):
            b = (last + step) % self.num_buckets
            if ctx.counts[b]:
                self._cursor[ctx.drafter_id] = b
                return b
        raise AssertionError("choose called with every bucket empty")

    def reset(self) -> None:
        self._cursor.clear()


def apportion(weights: Sequence[float], total: int) -> list[int]:
    """`total` items split in proportion to the non-negative part of `weights`, largest remainder
    first (ties to the lower bucket); all zero weights: an even split."""
    w = [max(0.0, x) for x in weights]
    s = sum(w)
    if s <= 0:
        w, s = [1.0] * len(weights), float(len(weights))
    exact = [x * total / s for x in w]
    out = [math.floor(x) for x in exact]
    for b in sorted(range(len(w)), key=lambda i: (out[i] - exact[i], i))[: total - sum(out)]:
        out[b] += 1
    return out


@dataclass
class _Round:
    quota: list[int]  # items per bucket this step still plans
    size: int | None = None  # only while draining: pulls beyond it end the step early
    taken: int = 0
    rank_cost: dict[int, float] = field(default_factory=dict)  # drafter cost dealt to each rank so far


@dataclass
class Stratified:
    num_buckets: int
    name: str = "stratified"
    jobs: list[int] = field(default_factory=list)  # scheduled per bucket
    shares: list[float] = field(default_factory=list)
    owed: list[float] = field(default_factory=list)  # items each bucket is owed (deficit), |.| <= a step
    draining: bool = False
    _rounds: dict[int, _Round] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.num_buckets
        self.jobs = self.jobs or [0] * n
        self.shares = self.shares or [1.0 / n] * n
        self.owed = self.owed or [0.0] * n

    def add_jobs(self, per_bucket: Sequence[int]) -> None:
        self.jobs = [a + b for a, b in zip(self.jobs, per_bucket)]
        self._data_shares()

    def _data_shares(self) -> None:
        total = sum(self.jobs)
        if total:
            self.shares = [j / total for j in self.jobs]

    def choose(self, ctx: PullContext, rng: random.Random) -> int | None:
        if ctx.producing_finished != self.draining:
            self.draining = ctx.producing_finished
            self.owed = [0.0] * self.num_buckets
            if self.draining:  # stratify what is left: the buffer's own mix becomes the shares
                self.shares = [c / sum(ctx.counts) for c in ctx.counts]
            else:  # jobs were re-queued after all: back to the data's shares
                self._data_shares()
            for r in self._rounds.values():
                r.size = ctx.step_items if self.draining and ctx.ranks_known else None
        rnd = self._rounds.get(ctx.round) or self._open_round(ctx)
        if rnd is None or (rnd.size is not None and rnd.taken >= rnd.size):
            return None
        live = [b for b in range(self.num_buckets) if ctx.counts[b] > 0]
        with_quota = [b for b in live if rnd.quota[b] > 0]
        # The step's composition is its quota; its order takes the fullest bucket first, which
        # keeps the largest bucket of the buffer small (backlog). No owed bucket on hand: the most
        # owed one that is.
        if with_quota:
            b = max(with_quota, key=lambda c: (ctx.counts[c], rnd.quota[c], -c))
            if ctx.ranks_known and any(ctx.costs):
                b = self._balanced(rnd, ctx, with_quota, b)
        else:
            b = max(live, key=lambda c: (self.owed[c], ctx.counts[c], -c))
        if rnd.quota[b] > 0:
            rnd.quota[b] -= 1
        rnd.taken += 1
        self.owed[b] = max(-ctx.step_items, self.owed[b] - 1)
        return b

    def _balanced(self, rnd: _Round, ctx: PullContext, candidates: list[int], fullest: int) -> int:
        """Deal for cost: of the buckets the step still owes, the one after which the rest of its
        quota, dealt largest first to the rank with the least cost and a free slot, leaves the ranks'
        costs closest together (ties: the fullest bucket). Only who gets what changes, never the
        step's composition: mixing comes first. (Taking an item the step does not owe when that
        balances better was tried: it bends the mix, and with one item per rank, where no dealing
        can balance, it starved the cheapest bucket until it filled the buffer.)"""
        return min(candidates, key=lambda c: (round(self._spread_after(rnd, ctx, c, ctx.costs[c]), 3),
                                              c != fullest, -ctx.counts[c], c))

    def _spread_after(self, rnd: _Round, ctx: PullContext, bucket: int, cost: float) -> float:
        """(max - min) / mean of the ranks' step costs if this rank takes an item of `bucket` costing
        `cost` and the rest of the quota is dealt largest first to the least-loaded rank with a slot."""
        loads = {d: rnd.rank_cost.get(d, 0.0) for d in ctx.round_slots}
        slots = dict(ctx.round_slots)
        loads[ctx.drafter_id] = loads.get(ctx.drafter_id, 0.0) + cost
        slots[ctx.drafter_id] = slots.get(ctx.drafter_id, 1) - 1
        rest = sorted((ctx.costs[c] for c in range(self.num_buckets)
                       for _ in range(rnd.quota[c] - (c == bucket))), reverse=True)
        for c in rest:
            free = [d for d in loads if slots[d] > 0]
            if not free:
                break
            d = min(free, key=lambda x: loads[x])
            loads[d] += c
            slots[d] -= 1
        mean = sum(loads.values()) / len(loads)
        return (max(loads.values()) - min(loads.values())) / mean if mean > 0 else 0.0

    def pick(self, ctx: PullContext, bucket: int, costs: Sequence[int], rng: random.Random) -> int | None:
        """While dealing for cost: of the bucket's items, one that leaves the ranks' projected step
        costs closest (a random one among equals); otherwise a random item."""
        rnd = self._rounds.get(ctx.round)
        if rnd is None or not (ctx.ranks_known and any(ctx.costs)) or len(costs) < 2:
            return None
        # The chosen bucket's quota unit is already taken off: project with it added back.
        rnd.quota[bucket] += 1
        try:
            score = [round(self._spread_after(rnd, ctx, bucket, c), 3) for c in costs]
        finally:
            rnd.quota[bucket] -= 1
        best = min(score)
        return rng.choice([i for i, x in enumerate(score) if x == best])

    def served(self, ctx: PullContext, bucket: int, cost: int) -> None:
        rnd = self._rounds.get(ctx.round)
        if rnd is not None:
            rnd.rank_cost[ctx.drafter_id] = rnd.rank_cost.get(ctx.drafter_id, 0.0) + cost

    def _open_round(self, ctx: PullContext) -> _Round | None:
        k = ctx.step_items
        size = None
        if self.draining and ctx.ranks_known:  # equal steps over what is left, no lone straggler
            # Items the ranks still inside earlier rounds will take are not this round's.
            left = sum(ctx.counts) - sum(min(max(0, (r.size or k) - r.taken), ctx.open_slots.get(n, 0))
                                         for n, r in self._rounds.items() if n < ctx.round)
            if left <= 0:
                return None
            size = k = math.ceil(left / math.ceil(left / max(1, ctx.step_items)))
        self.owed = [min(ctx.step_items, o + k * s) for o, s in zip(self.owed, self.shares)]
        # What open rounds still plan to serve is owed already: do not plan it twice.
        planned = [sum(r.quota[b] for r in self._rounds.values()) for b in range(self.num_buckets)]
        rnd = _Round(apportion([o - p for o, p in zip(self.owed, planned)], k), size)
        self._rounds[ctx.round] = rnd
        for r in [r for r in self._rounds if r < ctx.round - 2]:
            del self._rounds[r]
        return rnd

    def reset(self) -> None:
        self._rounds.clear()


POLICIES = {Stratified.name: Stratified, RoundRobin.name: RoundRobin}
DEFAULT_POLICY = Stratified.name


def make_pull_policy(policy: "str | PullPolicy", num_buckets: int) -> PullPolicy:
    """A policy by name (the config's `pool.pull_policy`), or an instance as given (benches bring
    their own)."""
    if isinstance(policy, str):
        return POLICIES[policy](num_buckets)
    return policy
