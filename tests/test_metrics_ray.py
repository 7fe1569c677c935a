"""While the tiny config trains, the node's Prometheus endpoint carries every DESIGN section 4 metric, and
the pool's buffer never lets one bucket pile up."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from app import metric_names as mn
from tests.e2e_helpers import assert_finished

pytestmark = [pytest.mark.ray, pytest.mark.slow]

DESIGN_METRICS = (mn.POOL_ITEMS, mn.POOL_BYTES, mn.JOBS, mn.PULL_WAIT_SECONDS + "_count", mn.SERVED_TOTAL,
                  mn.TARGET_TOKENS_TOTAL, mn.TARGET_BUSY_RATIO, mn.TRAIN_TOKENS_TOTAL, mn.TRAIN_STEP,
                  mn.TRAIN_LOSS, mn.DRAFTER_DATA_WAIT_RATIO, mn.STEP_MIX_TV, mn.POOL_BACKLOG_SHARE)
LINE = re.compile(r"^(?:ray_)?(dflash_\w+)\{([^}]*)\} ([0-9.eE+-]+)$")


def _parse(text: str) -> dict[str, list[tuple[dict, float]]]:
    """One scrape's lines (already those of the run's label) by metric name: [(labels, value)]."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        labels = dict(kv.split("=", 1) for kv in re.findall(r'(\w+="[^"]*")', m.group(2)))
        labels = {k: v.strip('"') for k, v in labels.items()}
        out.setdefault(m.group(1), []).append((labels, float(m.group(3))))
    return out


def test_every_design_metric_is_exported_with_sane_values(reference_run) -> None:
    """The session's reference run, scraped every second while it trained (tests/e2e_helpers.py)."""
    assert_finished(reference_run)
    run_dir = reference_run.run_dir
    scrapes = [_parse(text) for text in reference_run.scrapes]
    assert all(labels.get("run") == reference_run.run_label for s in scrapes for rows in s.values()
               for labels, _ in rows)
    seen = set().union(*scrapes)
    missing = [name for name in DESIGN_METRICS if name not in seen]
    assert not missing, f"never scraped: {missing}; saw {sorted(seen)}"
    for scrape in scrapes:
        items = sum(v for _, v in scrape.get(mn.POOL_ITEMS, []))
        assert items <= 16  # conf/tiny.yaml pool.capacity
        for _, v in scrape.get(mn.POOL_BYTES, []):
            assert 0 <= v <= 268435456  # pool.capacity_bytes
        for labels, v in (scrape.get(mn.TARGET_BUSY_RATIO, []) + scrape.get(mn.DRAFTER_DATA_WAIT_RATIO, [])
                          + scrape.get(mn.STEP_MIX_TV, []) + scrape.get(mn.POOL_BACKLOG_SHARE, [])):
            assert 0.0 <= v <= 1.0, labels
        assert {l["bucket"] for l, _ in scrape.get(mn.POOL_ITEMS, [])} <= {str(b) for b in range(6)}
    tokens = [sum(v for _, v in s.get(mn.TRAIN_TOKENS_TOTAL, [])) for s in scrapes]
    rising = [t for t in tokens if t > 0]
    assert len(set(rising)) >= 2 and rising == sorted(rising), tokens
    states = {l["state"] for s in scrapes for l, _ in s.get(mn.JOBS, [])}
    assert states == {"pending", "in_flight", "buffered", "leased", "acked"}
    _no_bucket_piles_up(run_dir, capacity=16)


def _no_bucket_piles_up(run_dir: Path, capacity: int) -> None:
    """The status line's q_hsb, as the run's timeline recorded it with the step records: once the
    drafters train (warm-up over), no bucket holds more than half of pool.capacity (the round-robin
    policy let the dominant bucket fill the pool: [0, 0, 0, 0, 0, 13] of 16)."""
    rows = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines() if line.strip()]
    first_step = min(r["t"] for r in rows if r["k"] == "step")
    pools = [r for r in rows if r["k"] == "pool" and r["t"] >= first_step]
    assert len(pools) >= 3, len(pools)
    worst = max(max(r["q_hsb"]) for r in pools)
    assert worst <= capacity // 2, [r["q_hsb"] for r in pools]
