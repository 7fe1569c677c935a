"""The driver's view of a run: step records and pool snapshots folded into one status line.

Pure: fed `StepRecord`s (from the pool, the telemetry hub) and `PoolStats`; the same numbers go
to the status line, wandb and `summary.json`.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from app.messages import StepRecord
from app.pool.telemetry import PoolStats

# Data-wait share above which the drafters are starving (targets are the bottleneck).
STARVING_WAIT_SHARE = 0.10
# Buffered share of capacity above which targets are blocked on a full pool (drafters are the bottleneck).
FULL_POOL_SHARE = 0.75


def bottleneck(data_wait_share: float, buffered: int, capacity: int) -> str:
    """Which side holds the run back: 'targets' (drafters wait for data), 'drafters' (pool full), or 'balanced'."""
    if data_wait_share > STARVING_WAIT_SHARE:
        return "targets"
    if capacity > 0 and buffered >= FULL_POOL_SHARE * capacity:
        return "drafters"
    return "balanced"


@dataclass
class _Window:
    """Rate over a sliding time window of a cumulative counter that may restart from zero."""

    seconds: float = 30.0
    points: deque = field(default_factory=deque)  # (time, cumulative value)
    _offset: float = 0.0  # what earlier incarnations of the counter had counted
    _last: float = 0.0

    def add(self, now: float, counter: float) -> None:
        # A recreated pool counts its targets' tokens from zero again: carry the old count forward
        # instead of reading the drop as a negative rate.
        if counter < self._last:
            self._offset += self._last
        self._last = counter
        total = self._offset + counter
        self.points.append((now, total))
        while len(self.points) > 2 and now - self.points[0][0] > self.seconds:
            self.points.popleft()

    def rate(self) -> float:
        if len(self.points) < 2:
            return 0.0
        (t0, v0), (t1, v1) = self.points[0], self.points[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0


class RunMonitor:
    """Accumulates what the driver reports; one instance per run.

    Handed at its construction the run's deciders it shows and summarises (app/run/elastic/planners.py):
    `advisor` (a SplitAdvisor, fed the same records and snapshots; its advice goes on the line),
    `rebalancer` (a Rebalancer: its word on the line; `off` hides the advice), `grower` (a GrowthPlanner:
    its growths in summary.json), `extra` (an ExtraPlanner: its word on the line, its bundles in
    summary.json), and `eval_every`, the steps rank 0 offers for evaluation (0: none), by which wandb
    holds each offered step's row for its tau. Other listeners join with `listen`."""

    def __init__(self, clock=time.monotonic, *, advisor=None, rebalancer=None, grower=None, extra=None,
                 eval_every: int = 0) -> None:
        self.clock = clock
        self.advisor, self.rebalancer, self.grower, self.extra = advisor, rebalancer, grower, extra
        self.eval_every = eval_every
        self.started = clock()
        self.step = 0
        self.epoch = 0
        self.loss_first: float | None = None
        self.loss_last: float | None = None
        self.accuracy = 0.0
        self.accept_len = 0.0
        self.per_pos_acc: list[float] = []
        self.top5_acc = 0.0
        self.train_tokens = 0
        self.compute_s: dict[int, float] = {}
        self.wait_s: dict[int, float] = {}
        self.events: list[str] = []
        self._train_rate = _Window()
        self._target_rate = _Window()
        self.last_progress = clock()
        self.first_record_t: float | None = None  # when the first and latest step reports arrived
        self.last_record_t = 0.0
        self.last_pool: PoolStats | None = None
        # Fed the same records, snapshots and events after the advisor (`listen`: the timeline file, wandb,
        # the evaluations during the run).
        self.listeners: list = [advisor] if advisor is not None else []
        self.tau_history: list[tuple[int, float]] = []  # (step, tau) of the evaluations during the run
        self.tau_best: tuple[int, float] | None = None
        self.tau_given_up: list[int] = []  # offered steps whose tau will not come (timed out, failed, replaced)
        # The learning checks of each evaluation (TauMeasurement.health: figures, verdicts, status), by step.
        self.health_by_step: dict[int, dict] = {}

    def listen(self, listener) -> None:
        """`listener` is fed every step record, pool snapshot and fault from now on (`add_records`, `add_pool`,
        `note`; `resplit_row` too if it has one), after those that joined before it."""
        self.listeners.append(listener)

    def add_records(self, records: list[StepRecord]) -> None:
        if records:
            now = self.clock()
            self.first_record_t = self.first_record_t if self.first_record_t is not None else now
            self.last_record_t = now
        for listener in self.listeners:
            listener.add_records(records)
        for rec in records:
            self.train_tokens += rec.tokens
            self.compute_s[rec.rank] = self.compute_s.get(rec.rank, 0.0) + rec.compute_s
            self.wait_s[rec.rank] = self.wait_s.get(rec.rank, 0.0) + rec.data_wait_s
            if rec.rank == 0:  # every rank carries the global step numbers; count them once
                self._rank0(rec)

    def restart_at(self, step: int) -> None:
        """A (re)built drafter group starts at `step`: progress counts from there, not from the
        highest step an earlier group reached before it was rolled back."""
        self.step = step
        self.last_progress = self.clock()

    def _rank0(self, rec: StepRecord) -> None:
        if rec.step > self.step:
            self.last_progress = self.clock()
        self.step, self.epoch = rec.step, max(self.epoch, rec.epoch)
        if self.loss_first is None:
            self.loss_first = rec.loss
        self.loss_last, self.accuracy, self.accept_len = rec.loss, rec.correct, rec.accept_len
        self.per_pos_acc = list(rec.per_pos_acc)
        if rec.topk_acc >= 0:
            self.top5_acc = rec.topk_acc

    def add_pool(self, stats: PoolStats) -> None:
        now = self.clock()
        self._train_rate.add(now, self.train_tokens)
        self._target_rate.add(now, sum(stats.tokens_by_target.values()))
        self.last_pool = stats
        for listener in self.listeners:
            listener.add_pool(stats)

    def train_tok_s(self) -> float:
        """All replicas' tokens per second over the training phase (first to last step report)."""
        if self.first_record_t is None:
            return 0.0
        span = self.last_record_t - self.first_record_t
        return self.train_tokens / span if span > 0 else 0.0

    def replica_tok_s(self) -> float:
        """Tokens per second of one replica while inside its step loop (compute + data wait)."""
        busy = sum(self.compute_s.values()) + sum(self.wait_s.values())
        return self.train_tokens / busy if busy > 0 else 0.0

    def data_wait_share(self) -> float:
        wait, busy = sum(self.wait_s.values()), sum(self.compute_s.values())
        return wait / (wait + busy) if wait + busy > 0 else 0.0

    def note(self, event: str) -> None:
        """A fault seen and what was done about it: shown in the status line and the summary."""
        self.events.append(event)
        for listener in self.listeners:
            listener.note(event)

    def resplit_event(self, kind: str, **row) -> None:
        """A re-split asked for, refused, done or measured: to the listeners that record it (the timeline)."""
        for listener in self.listeners:
            if hasattr(listener, "resplit_row"):
                listener.resplit_row(kind, **row)

    def known_best(self, step: int, tau: float) -> None:
        """A resumed run's best drafter (drafter-best/) before any evaluation of this start: on the line and
        in the summary until a better tau comes."""
        self.tau_best = (step, tau)

    def add_tau(self, step: int, tau: float) -> bool:
        """An acceptance length measured during the run; True when it beats every earlier one."""
        self.tau_history.append((step, tau))
        best = self.tau_best is None or tau > self.tau_best[1]
        if best:
            self.tau_best = (step, tau)
        return best

    def add_health(self, step: int, health: dict | None) -> None:
        """The learning checks of the evaluation at `step` (app/model/health.py); the newest one's word goes on
        the status line."""
        if health is not None:
            self.health_by_step[step] = health

    @property
    def health_last(self) -> dict | None:
        return self.health_by_step[max(self.health_by_step)] if self.health_by_step else None

    def give_up_tau(self, step: int) -> None:
        """The evaluation offered at `step` will report no tau."""
        self.tau_given_up.append(step)

    def split_advice(self) -> dict | None:
        """The advisor's current estimate and the numbers behind it (for summary.json), stable or not."""
        est = self.advisor.estimate() if self.advisor is not None else None
        return est.to_dict() if est is not None else None

    def values(self) -> dict[str, float | int | str]:
        """The numbers of the status line, for wandb."""
        stats = self.last_pool
        q = stats.q_hsb if stats else []
        return {
            "step": self.step, "epoch": self.epoch, "loss": self.loss_last or 0.0, "accuracy": self.accuracy,
            "accept_len": self.accept_len, "top5_acc": self.top5_acc,
            **{f"acc_pos{k + 1}": a for k, a in enumerate(self.per_pos_acc)}, "target_tok_s": self._target_rate.rate(),
            "train_tok_s": self._train_rate.rate(), "data_wait": self.data_wait_share(),
            "q_hsb": str(q), "buffered": stats.buffered if stats else 0,
            "acked": stats.acked if stats else 0, "total_jobs": stats.total_jobs if stats else 0,
            "bottleneck": bottleneck(self.data_wait_share(), stats.buffered if stats else 0,
                                     stats.capacity_items if stats else 0),
            "advice": advice.text() if (advice := self.advisor and self.advisor.advice())
            and (self.rebalancer is None or self.rebalancer.shows_advice) else "",
            "rebalance": " | ".join(word for word in (self.rebalancer.status() if self.rebalancer is not None else "",
                                                      self.extra.status() if self.extra is not None else "") if word),
            # A resumed run may know its best drafter (drafter-best/) before any evaluation of this start.
            **({"tau": (self.tau_history or [self.tau_best])[-1][1], "tau_best": self.tau_best[1]}
               if self.tau_best else {}),
            # The newest evaluation's learning checks: ok, or its first verdict (+N more).
            **({"health": self.health_last["status"]} if self.health_last else {}),
        }

    def line(self) -> str:
        v = self.values()
        faults = f" | faults={len(self.events)} last: {self.events[-1]}" if self.events else ""
        advice = f" ({v['advice']})" if v["advice"] else ""
        advice += f" | {v['rebalance']}" if v["rebalance"] else ""
        tau = f" tau {v['tau']:.2f} (best {self.tau_best[1]:.2f} @{self.tau_best[0]})" if self.tau_best else ""
        tau += f" health {v['health']}" if "health" in v else ""
        return (
            f"step {v['step']} ep {v['epoch']} jobs {v['acked']}/{v['total_jobs']} | loss {v['loss']:.3f} "
            f"acc {v['accuracy']:.3f} accept_len {v['accept_len']:.2f}{tau} | target {v['target_tok_s']:.0f} tok/s "
            f"train {v['train_tok_s']:.0f} tok/s | q_hsb={v['q_hsb']} data_wait {100 * v['data_wait']:.0f}% "
            f"| bottleneck: {v['bottleneck']}{advice}{faults}"
        )
