"""Ray metrics of the pool actor (names in app/metric_names.py).

Every metric carries the tag `run`. Gauges are re-set on every tick (the pool calls `tick` every
pool.metrics_every_s seconds) because Ray drops gauges that are not refreshed. Counters are fed
deltas on each tick from the pool's snapshot (PoolStats, which carries the reported restarts and
tau too), pull waits are observed in batches and step records folded in before each tick, so the
pull/ack hot path makes no metrics calls at all.

Prometheus names as scraped from Ray 2.60: each name gets the `ray_` prefix
(`ray_dflash_pool_items`); a Counter named `dflash_served_total` is exported as
`ray_dflash_served_total` (no extra suffix); histograms add `_bucket`, `_sum`, `_count`.
"""
from __future__ import annotations

import math
import time
from typing import Any

from app import metric_names as mn
from app.messages import StepRecord
from app.pool.book import JobState
from app.pool.telemetry import PoolStats

JOB_STATES = tuple(s.value for s in JobState)
WAIT_BOUNDARIES_S = [0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0]


class PoolMetrics:
    """Owns the ray.util.metrics objects; fed from PoolStats snapshots and step records."""

    def __init__(self, run_name: str, drafter_run: str = "") -> None:
        """`drafter_run`: the run of a sweep (`runs:`) these series are for, a label of each; "" = one run."""
        from ray.util.metrics import Counter, Gauge, Histogram

        self.run, self.drafter_run = run_name, drafter_run
        run = ("run", "drafter_run") if drafter_run else ("run",)
        self.pool_items = Gauge(mn.POOL_ITEMS, "Buffered items per length bucket (q_hsb)", run + ("bucket",))
        self.pool_bytes = Gauge(mn.POOL_BYTES, "Bytes buffered + leased + reserved in flight", run)
        self.capacity_bytes = Gauge(mn.POOL_CAPACITY_BYTES, "The pool's byte cap", run)
        self.jobs = Gauge(mn.JOBS, "Jobs by state", run + ("state",))
        self.pull_wait = Histogram(
            mn.PULL_WAIT_SECONDS, "Seconds a pull waited for an item", WAIT_BOUNDARIES_S, run
        )
        self.served = Counter(mn.SERVED_TOTAL, "Items served per bucket", run + ("bucket",))
        self.step_mix_tv = Gauge(mn.STEP_MIX_TV, "Mean TV distance of the recent global steps' bucket mix "
                                 "from the data's bucket shares (0 = stratified)", run)
        self.backlog = Gauge(mn.POOL_BACKLOG_SHARE, "Time-averaged share of the buffer held by its largest "
                             "bucket since the previous tick", run)
        self.target_tokens = Counter(mn.TARGET_TOKENS_TOTAL, "Tokens produced per target", run + ("target",))
        self.target_busy = Gauge(mn.TARGET_BUSY_RATIO, "Forward time / wall time per target", run + ("target",))
        self.train_tokens = Counter(mn.TRAIN_TOKENS_TOTAL, "Tokens trained (all drafters)", run)
        self.train_step = Gauge(mn.TRAIN_STEP, "Latest optimizer step", run)
        self.train_loss = Gauge(mn.TRAIN_LOSS, "Loss of the latest complete step", run)
        self.data_wait = Gauge(
            mn.DRAFTER_DATA_WAIT_RATIO, "Data wait / (wait + compute) per drafter", run + ("drafter",)
        )
        self.restarts = Counter(mn.RESTARTS_TOTAL, "Target restarts and drafter-group rebuilds", run + ("kind",))
        self.tau = Gauge(mn.TAU, "Acceptance length (tau) of the latest evaluation during the run", run)
        self.health = Gauge(mn.HEALTH, "The latest evaluation's learning checks (app/model/health.py)", run + ("check",))
        self.health_verdict = Gauge(mn.HEALTH_VERDICT, "1 while the latest evaluation gives this verdict",
                                    run + ("verdict",))
        self._last_backlog: tuple[float, float] | None = None  # (share x seconds, seconds) at the last tick
        self._last_served: dict[int, int] = {}  # running totals at the previous tick
        self._last_tokens: dict[int, int] = {}
        self._last_restarts: dict[str, int] = {}
        self._last_forward: dict[int, tuple[float, float]] = {}  # target -> (forward_s, wall time)
        self._busy: dict[int, float] = {}
        self._wait_ratio: dict[int, float] = {}
        self._step = -1
        self._loss: float | None = None

    def _t(self, **tags: Any) -> dict[str, str]:
        run = {"run": self.run, "drafter_run": self.drafter_run} if self.drafter_run else {"run": self.run}
        return {**run, **{k: str(v) for k, v in tags.items()}}

    def tick(self, st: PoolStats, waits: list[float], now: float | None = None) -> None:
        """Re-set every gauge and feed counters the deltas since the previous tick."""
        now = time.monotonic() if now is None else now
        for b, n in enumerate(st.q_hsb):
            self.pool_items.set(n, self._t(bucket=b))
        self.pool_bytes.set(st.pool_bytes, self._t())
        self.capacity_bytes.set(st.capacity_bytes, self._t())
        for state, n in st.jobs_by_state().items():
            self.jobs.set(n, self._t(state=state))
        for w in waits:
            self.pull_wait.observe(w, self._t())
        if st.steps_measured and not math.isnan(st.step_mix_tv):
            self.step_mix_tv.set(st.step_mix_tv, self._t())
        self._backlog_gauge(st)
        self._counters(st)
        self._target_busy(st, now)
        for t, ratio in self._busy.items():
            self.target_busy.set(ratio, self._t(target=t))
        for d, ratio in self._wait_ratio.items():
            self.data_wait.set(ratio, self._t(drafter=d))
        if self._step >= 0:
            self.train_step.set(self._step, self._t())
        if self._loss is not None:
            self.train_loss.set(self._loss, self._t())
        if st.tau is not None:  # the latest evaluation during the run, as the driver reported it
            self.tau.set(st.tau, self._t())
        if st.health is not None:
            self._health(st.health)

    def _health(self, health: dict) -> None:
        """Every check's figure, and each verdict 1 or 0 (a verdict gone since the last evaluation reads 0)."""
        from app.model.health_verdicts import VERDICT_ORDER

        for check, value in health["checks"].items():
            self.health.set(value, self._t(check=check))
        for name in VERDICT_ORDER:
            self.health_verdict.set(1.0 if name in health["verdicts"] else 0.0, self._t(verdict=name))

    def _counters(self, st: PoolStats) -> None:
        self._deltas(self.served, dict(enumerate(st.served_per_bucket)), self._last_served, "bucket")
        self._deltas(self.target_tokens, st.tokens_by_target, self._last_tokens, "target")
        self._deltas(self.restarts, st.restarts, self._last_restarts, "kind")  # restarts and rebuilds

    def _deltas(self, counter: Any, totals: dict, last: dict, tag: str) -> None:
        """Feed `counter` what each running total grew by since the previous tick."""
        for key, n in totals.items():
            if n > last.get(key, 0):
                counter.inc(n - last.get(key, 0), self._t(**{tag: key}))
                last[key] = n

    def _backlog_gauge(self, st: PoolStats) -> None:
        """The buffer's largest-bucket share, time-averaged over the last tick interval (the pool's
        all-time average until the second tick; nothing while production is over)."""
        integral, seconds = st.backlog_integral, st.backlog_seconds
        prev, self._last_backlog = self._last_backlog, (integral, seconds)
        if prev is not None and seconds > prev[1]:
            self.backlog.set((integral - prev[0]) / (seconds - prev[1]), self._t())
        elif prev is None and seconds > 0:
            self.backlog.set(integral / seconds, self._t())

    def _target_busy(self, st: PoolStats, now: float) -> None:
        for t, fwd in st.forward_s_by_target.items():
            prev = self._last_forward.get(t)
            self._last_forward[t] = (fwd, now)
            if prev is not None and now > prev[1]:
                self._busy[t] = min(1.0, max(0.0, (fwd - prev[0]) / (now - prev[1])))

    def step(self, rec: StepRecord) -> None:
        """Fold one rank's step record in: tokens, data-wait ratio, the newest step and its loss."""
        if rec.tokens > 0:
            self.train_tokens.inc(rec.tokens, self._t())
        total = rec.compute_s + rec.data_wait_s
        if total > 0:
            self._wait_ratio[rec.rank] = rec.data_wait_s / total
        if rec.step >= self._step:  # every rank carries the step's global loss; keep the newest
            self._step, self._loss = rec.step, rec.loss
