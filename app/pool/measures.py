"""Mixing measures, computed the same way for every pull policy: by the pool (stats, metrics) and by
the benches (`python -m app.bench sched`).

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
from collections.abc import Iterable, Sequence


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
