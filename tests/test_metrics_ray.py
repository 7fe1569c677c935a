"""While the tiny config trains, the node's Prometheus endpoint carries every DESIGN section 4 metric, and
the pool's buffer never lets one bucket pile up."""
from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from app import metric_names as mn
from app.config.load import load_config
from app.run.plan import run_name
from tests.e2e_helpers import ROOT, run_in_process, tiny_overrides

pytestmark = [pytest.mark.ray, pytest.mark.slow]

DESIGN_METRICS = (mn.POOL_ITEMS, mn.POOL_BYTES, mn.JOBS, mn.PULL_WAIT_SECONDS + "_count", mn.SERVED_TOTAL,
                  mn.TARGET_TOKENS_TOTAL, mn.TARGET_BUSY_RATIO, mn.TRAIN_TOKENS_TOTAL, mn.TRAIN_STEP,
                  mn.TRAIN_LOSS, mn.DRAFTER_DATA_WAIT_RATIO, mn.STEP_MIX_TV, mn.POOL_BACKLOG_SHARE)
LINE = re.compile(r"^(?:ray_)?(dflash_\w+)\{([^}]*)\} ([0-9.eE+-]+)$")


def _scrape(port: int, run: str) -> dict[str, list[tuple[dict, float]]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, list[tuple[dict, float]]] = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        labels = dict(kv.split("=", 1) for kv in re.findall(r'(\w+="[^"]*")', m.group(2)))
        labels = {k: v.strip('"') for k, v in labels.items()}
        if labels.get("run") == run:
            out.setdefault(m.group(1), []).append((labels, float(m.group(3))))
    return out


def test_every_design_metric_is_exported_with_sane_values(ray_cluster, tmp_path: Path) -> None:
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port
    run_dir = tmp_path / "metrics-run"
    run_label = run_name(load_config(ROOT / "conf/tiny.yaml", tiny_overrides(run_dir)))  # folder name + digest
    result: dict[str, int] = {}
    worker = threading.Thread(target=lambda: result.update(code=run_in_process(run_dir, "train.epochs=8")))
    worker.start()
    scrapes = []
    while worker.is_alive():
        scrapes.append(_scrape(port, run_label))
        time.sleep(1.0)
    worker.join()
    assert result["code"] == 0
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
