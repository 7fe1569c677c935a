"""The pool's counters and meters: everything `PoolStats` reports beyond the queue and lease state.

`HSPool` tells `PoolTelemetry` what happened (jobs scheduled, an item landed or was served, a pull
waited, a stale or duplicate call, a step report) and splices `fields(now)` into its snapshot. Nothing
here decides anything: the pool would behave the same without it.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from app.messages import ItemMeta
from app.pool.measures import BacklogMeter, StepMix, shares_of
from app.pool.stats import WaitSnapshot


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
        self.acked_twice = 0
        self.stale_results = 0
        self.stale_acks = 0
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
            acked_twice=self.acked_twice,
            stale_results=self.stale_results,
            stale_acks=self.stale_acks,
            lost_payloads=self.lost_payloads,
            data_shares=shares,
            step_mix_tv=self.step_mix.mean_tv(shares),
            steps_measured=self.step_mix.count,
            backlog_share=self.backlog.value(now),
            backlog_integral=self.backlog.integral,
            backlog_seconds=self.backlog.seconds,
        )
