"""The pool's snapshot for the driver, the watchdog and the metrics exporter."""
from __future__ import annotations

from dataclasses import dataclass, field


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
    broken_targets: list[int] = field(default_factory=list)  # raised on every job lately (app/pool/strikes.py)
    # Filled in by the actor's control state (app/pool/control.py; HSPool leaves them empty):
    target_failures: list = field(default_factory=list)  # app.messages.TargetFailure, oldest first
    targets: list[int] = field(default_factory=list)  # registered targets
    paused_targets: list[int] = field(default_factory=list)  # evaluating: no training jobs meanwhile
    eval_offers_superseded: int = 0  # eval offers replaced in the pool by a newer one before taken
    restarts: dict[str, int] = field(default_factory=dict)  # reported restarts per kind (target, drafter_group, pool, resplit, grow, extra)
    tau: float | None = None  # the latest evaluation's tau, as the driver reported it
    health: dict | None = None  # its learning checks: {"checks": {name: value}, "verdicts": [names]} (None = none)

    def jobs_by_state(self) -> dict[str, int]:
        return {
            "pending": self.pending,
            "in_flight": self.in_flight,
            "buffered": self.buffered,
            "leased": self.leased,
            "acked": self.acked,
        }
