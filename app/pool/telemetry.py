"""The pool's counters and meters, and the snapshot they feed (`PoolStats`, for the driver, the watchdog
and the metrics exporter).

`HSPool` tells `PoolTelemetry` what happened (jobs scheduled, an item landed or was served, a pull
waited, a stale or duplicate call, a step report) and splices `fields(now)` into its snapshot. Nothing
here decides anything: the pool would behave the same without it. Mixing measures, the same for every
pull policy, by the pool (stats, metrics) and the benches (`python -m app.bench sched`):
- step_tv: per global step (all ranks' micro-batches of one optimizer step), the total-variation
  distance between the step's bucket composition and the data's bucket shares, averaged over steps.
- step_tv_floor: the same for the schedule's own order cut into steps of the same size: what a
  policy that received jobs exactly in schedule order would get.
- backlog: time-averaged share of the buffer held by its largest bucket (while items are buffered
  and production goes on; the final drain, where a buffer of few items is lopsided by arithmetic,
  is left out).
- tail_single: share of the last 15% of steps drawn from one bucket only.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.messages import ItemMeta


@dataclass(frozen=True)
class WaitSnapshot:
    """Pull wait times: all-time count and sum, p50/p95 over the recent window."""

    count: int = 0
    sum_s: float = 0.0
    p50_s: float = 0.0
    p95_s: float = 0.0


@dataclass(frozen=True)
class PoolStats:
    """One consistent snapshot of the pool.

    Jobs by state: pending (queued), in_flight (on a target), buffered (in a bucket), leased
    (pulled, not acked), acked (in the ledger, restored ones included); they sum to total_jobs.
    `oldest_in_flight_age_s[t]` is what the watchdog compares with its stall timeout.
    """

    q_hsb: list[int]  # buffered items per bucket
    pool_bytes: int
    capacity_bytes: int
    capacity_items: int
    pending: int
    in_flight: int
    buffered: int
    leased: int
    acked: int
    total_jobs: int
    pull_waits: WaitSnapshot
    served_per_bucket: list[int]
    produced_per_bucket: list[int]
    in_flight_by_target: dict[int, list[tuple[int, float]]]  # target -> [(job_id, start monotonic)]
    oldest_in_flight_age_s: dict[int, float]
    done_by_target: dict[int, int]
    tokens_by_target: dict[int, int]
    forward_s_by_target: dict[int, float]
    leased_by_drafter: dict[int, int]
    acked_twice: int
    stale_results: int
    stale_acks: int
    lost_payloads: int
    bytes_overshoot: int
    producing_finished: bool
    done: bool
    eos_drafters: list[int] = field(default_factory=list)
    data_shares: list[float] = field(default_factory=list)  # each bucket's share of the scheduled jobs
    step_mix_tv: float = float("nan")  # mean TV of the recent global steps' mix from data_shares
    steps_measured: int = 0
    backlog_share: float = float("nan")  # time-averaged share of the buffer held by its largest bucket
    backlog_integral: float = 0.0  # that share x seconds, and the seconds averaged over (for windows)
    backlog_seconds: float = 0.0
    quarantined: dict[int, str] = field(default_factory=dict)  # poison job id -> its last forward error
    broken_targets: list[int] = field(default_factory=list)  # raised on every job lately (app/pool/sides.py)
    # Filled in by the actor's control state (app/pool/stream.py PoolControl; HSPool leaves them empty):
    target_failures: list = field(default_factory=list)  # app.messages.TargetFailure, oldest first
    targets: list[int] = field(default_factory=list)  # registered targets
    paused_targets: list[int] = field(default_factory=list)  # evaluating: no training jobs meanwhile
    eval_offers_superseded: int = 0  # eval offers replaced in the pool by a newer one before taken
    restarts: dict[str, int] = field(default_factory=dict)  # reported restarts per kind (target, drafter_group, pool, resplit, grow, extra)
    tau: float | None = None  # the latest evaluation's tau, as the driver reported it
    health: dict | None = None  # its learning checks: {"checks": {name: value}, "verdicts": [names]} (None = none)

    def jobs_by_state(self) -> dict[str, int]:
        return {state: getattr(self, state) for state in ("pending", "in_flight", "buffered", "leased", "acked")}


class WaitStats:
    """Accumulates pull wait times: all-time count and sum, percentiles over the last `window` pulls,
    and the waits since the last `drain` (the metrics exporter observes them in batches)."""

    def __init__(self, window: int = 512, undrained: int = 65536) -> None:
        self.count = 0
        self.sum_s = 0.0
        self._recent: deque[float] = deque(maxlen=window)
        self._undrained: deque[float] = deque(maxlen=undrained)  # bounded: nobody drains a simulated pool

    def add(self, seconds: float) -> None:
        self.count += 1
        self.sum_s += seconds
        self._recent.append(seconds)
        self._undrained.append(seconds)

    def drain(self) -> list[float]:
        """The waits added since the previous drain, oldest first."""
        out = list(self._undrained)
        self._undrained.clear()
        return out

    def snapshot(self) -> WaitSnapshot:
        if not self._recent:
            return WaitSnapshot(self.count, self.sum_s)
        xs = sorted(self._recent)
        return WaitSnapshot(self.count, self.sum_s, _quantile(xs, 0.50), _quantile(xs, 0.95))


def _quantile(sorted_xs: list[float], q: float) -> float:
    """Nearest-rank quantile of an already sorted list."""
    k = min(len(sorted_xs) - 1, max(0, round(q * (len(sorted_xs) - 1))))
    return sorted_xs[k]


@dataclass
class TargetTally:
    """What one target produced: items, tokens, seconds of forward."""

    done: int = 0
    tokens: int = 0
    forward_s: float = 0.0


class PoolTelemetry:
    """Per-bucket counts (scheduled, produced, served), per-target tallies, the pull waits, the
    calls the pool ignored (stale results and acks, double acks), lost payloads, the buffer's
    backlog meter and the global steps' bucket mix."""

    def __init__(self, num_buckets: int) -> None:
        self.scheduled = [0] * num_buckets  # jobs added per bucket
        self.served = [0] * num_buckets
        self.produced = [0] * num_buckets
        self.targets: dict[int, TargetTally] = {}
        self.waits = WaitStats()
        self.backlog = BacklogMeter()
        self.step_mix = StepMix(num_buckets)
        self.acked_twice = self.stale_results = self.stale_acks = 0  # calls the pool ignored
        self.lost_payloads = 0

    def added(self, per_bucket: Sequence[int]) -> None:
        self.scheduled = [a + b for a, b in zip(self.scheduled, per_bucket)]

    def landed(self, target_id: int, meta: ItemMeta) -> None:
        """A target's item reached the buffer."""
        self.produced[meta.bucket] += 1
        tally = self.targets.setdefault(target_id, TargetTally())
        tally.done += 1
        tally.tokens += meta.num_tokens
        tally.forward_s += meta.forward_s

    def data_shares(self) -> list[float]:
        """Each bucket's share of the scheduled jobs."""
        return shares_of(self.scheduled)

    def record_step(self, step: int, buckets: Iterable[int]) -> None:
        self.step_mix.add(step, buckets)

    def fields(self, now: float) -> dict[str, Any]:
        """The PoolStats fields this owns, as keyword arguments."""
        shares = self.data_shares()
        return dict(
            pull_waits=self.waits.snapshot(),
            served_per_bucket=list(self.served),
            produced_per_bucket=list(self.produced),
            done_by_target={t: c.done for t, c in self.targets.items()},
            tokens_by_target={t: c.tokens for t, c in self.targets.items()},
            forward_s_by_target={t: c.forward_s for t, c in self.targets.items()},
            acked_twice=self.acked_twice, stale_results=self.stale_results, stale_acks=self.stale_acks,
            lost_payloads=self.lost_payloads, data_shares=shares, step_mix_tv=self.step_mix.mean_tv(shares),
            steps_measured=self.step_mix.count, backlog_share=self.backlog.value(now),
            backlog_integral=self.backlog.integral, backlog_seconds=self.backlog.seconds,
        )


# ---- mixing measures ---------------------------------------------------------------------------

def shares_of(counts: Sequence[float]) -> list[float]:
    total = sum(counts)
    return [c / total for c in counts] if total > 0 else [0.0] * len(counts)


def tv_distance(counts: Sequence[int], shares: Sequence[float]) -> float:
    """0.5 x sum |counts/total - shares|: 0 for a perfect stratified sample, 1 for disjoint."""
    total = sum(counts)
    if total == 0:
        return 0.0
    return 0.5 * sum(abs(c / total - s) for c, s in zip(counts, shares))


def bucket_counts(buckets: Iterable[int], num_buckets: int) -> list[int]:
    out = [0] * num_buckets
    for b in buckets:
        out[b] += 1
    return out


def step_tv(steps: Iterable[Sequence[int]], shares: Sequence[float]) -> float:
    """Mean TV distance of non-empty steps (each a count vector per bucket) from `shares`."""
    tvs = [tv_distance(s, shares) for s in steps if sum(s)]
    return sum(tvs) / len(tvs) if tvs else float("nan")


def step_tv_floor(schedule_buckets: Sequence[int], step_items: int, num_buckets: int,
                  shares: Sequence[float] | None = None) -> float:
    """step_tv of the schedule's own order cut into full steps of `step_items` jobs."""
    if shares is None:
        shares = shares_of(bucket_counts(schedule_buckets, num_buckets))
    full = len(schedule_buckets) // step_items * step_items
    steps = [bucket_counts(schedule_buckets[i:i + step_items], num_buckets) for i in range(0, full, step_items)]
    return step_tv(steps, shares)


def tail_single(steps: Sequence[Sequence[int]], tail: float = 0.15) -> float:
    """Share of the last `tail` of the non-empty steps whose items all come from one bucket."""
    steps = [s for s in steps if sum(s)]
    if not steps:
        return float("nan")
    last = steps[-max(1, math.ceil(tail * len(steps))):]
    return sum(1 for s in last if sum(1 for c in s if c) == 1) / len(last)


class BacklogMeter:
    """Time average of max(counts)/sum(counts), integrated between updates while `active`."""

    def __init__(self) -> None:
        self.integral = 0.0  # share x seconds
        self.seconds = 0.0
        self._last: tuple[float, float] | None = None  # (time, share) of the running segment

    def update(self, now: float, counts: Sequence[int], active: bool = True) -> None:
        """The buffer holds `counts` from `now` on; `active` False pauses the average."""
        if self._last is not None:
            t0, share = self._last
            self.integral += share * (now - t0)
            self.seconds += now - t0
        total = sum(counts)
        self._last = (now, max(counts) / total) if active and total > 0 else None

    def value(self, now: float | None = None) -> float:
        """The average up to `now` (or the last update)."""
        integral, seconds = self.integral, self.seconds
        if now is not None and self._last is not None:
            integral += self._last[1] * (now - self._last[0])
            seconds += now - self._last[0]
        return integral / seconds if seconds > 0 else float("nan")


class StepMix:
    """Global steps' bucket compositions from per-rank step reports, and their mean TV.

    Ranks report each step separately and out of order; a step counts once a report of a step two
    or more later has arrived (ranks run in lockstep, so by then every rank reported it). After a
    rebuild from a checkpoint, step numbers repeat: a report for an already counted step opens it
    again and drops the dead group's open steps after it.
    """

    def __init__(self, num_buckets: int, window: int = 64) -> None:
        self.num_buckets = num_buckets
        self.window = window
        self._open: dict[int, list[int]] = {}
        self._closed: set[int] = set()
        self._newest = -1
        self.recent: list[list[int]] = []  # the last `window` counted steps
        self.count = 0

    def add(self, step: int, buckets: Iterable[int]) -> None:
        if step in self._closed:  # a rebuilt group repeats step numbers: the dead group's later,
            self._closed.clear()   # unfinished steps are gone with its updates; start over from here
            self._open = {s: c for s, c in self._open.items() if s < step}
            self._newest = step
        counts = self._open.setdefault(step, [0] * self.num_buckets)
        for b in buckets:
            counts[b] += 1
        self._newest = max(self._newest, step)
        for s in sorted(k for k in self._open if k <= self._newest - 2):
            done = self._open.pop(s)
            self._closed.add(s)
            if sum(done):
                self.recent = (self.recent + [done])[-self.window:]
                self.count += 1
        if len(self._closed) > 4 * self.window:
            self._closed = {s for s in self._closed if s > self._newest - 2 * self.window}

    def mean_tv(self, shares: Sequence[float]) -> float:
        return step_tv(self.recent, shares)
