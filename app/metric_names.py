"""The Ray metric names this application exports, in one place.

Ray's Prometheus exporter prefixes each with `ray_`; histograms add `_bucket`/`_sum`/`_count`.
The Grafana dashboard test checks its queries against this list.
"""
from __future__ import annotations

POOL_ITEMS = "dflash_pool_items"  # gauge {bucket}
POOL_BYTES = "dflash_pool_bytes"  # gauge
POOL_CAPACITY_BYTES = "dflash_pool_capacity_bytes"  # gauge
JOBS = "dflash_jobs"  # gauge {state}: pending, in_flight, buffered, leased, acked
PULL_WAIT_SECONDS = "dflash_pull_wait_seconds"  # histogram
SERVED_TOTAL = "dflash_served_total"  # counter {bucket}
STEP_MIX_TV = "dflash_step_mix_tv"  # gauge: recent global steps' TV distance from the data's bucket shares
POOL_BACKLOG_SHARE = "dflash_pool_backlog_share"  # gauge: share of the buffer held by its largest bucket
TARGET_TOKENS_TOTAL = "dflash_target_tokens_total"  # counter {target}
TARGET_BUSY_RATIO = "dflash_target_busy_ratio"  # gauge {target}
TRAIN_TOKENS_TOTAL = "dflash_train_tokens_total"  # counter
TRAIN_STEP = "dflash_train_step"  # gauge
TRAIN_LOSS = "dflash_train_loss"  # gauge
DRAFTER_DATA_WAIT_RATIO = "dflash_drafter_data_wait_ratio"  # gauge {drafter}
RESTARTS_TOTAL = "dflash_restarts_total"  # counter {kind}
TAU = "dflash_tau"  # gauge: acceptance length of the latest evaluation during the run
HEALTH = "dflash_health"  # gauge {check}: the latest evaluation's learning checks (tau_fit, tau_no_features, ...)
HEALTH_VERDICT = "dflash_health_verdict"  # gauge {verdict}: 1 while the latest evaluation gives that verdict, else 0

ALL = (
    POOL_ITEMS,
    POOL_BYTES,
    POOL_CAPACITY_BYTES,
    JOBS,
    PULL_WAIT_SECONDS,
    SERVED_TOTAL,
    STEP_MIX_TV,
    POOL_BACKLOG_SHARE,
    TARGET_TOKENS_TOTAL,
    TARGET_BUSY_RATIO,
    TRAIN_TOKENS_TOTAL,
    TRAIN_STEP,
    TRAIN_LOSS,
    DRAFTER_DATA_WAIT_RATIO,
    RESTARTS_TOTAL,
    TAU,
    HEALTH,
    HEALTH_VERDICT,
)
