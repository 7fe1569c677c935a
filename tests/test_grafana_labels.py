"""The Grafana dashboard (docker/grafana/dflash.json) asks only for labels the pool's metrics carry (issue 36).

tests/test_docker.py checks the metric names; here every label a query names (a matcher, a `by (...)`,
a legend's `{{label}}`, the `run` variable's `label_values`) must be one the pool sets on that metric:
the tag keys of the real ray.util.metrics objects actors/pool_metrics.py builds (no cluster needed),
plus `le` on a histogram's `_bucket` series. Ray's exporter adds its own labels (SessionName, ...);
the dashboard does not use them, so they are not allowed here either.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

DASHBOARD = Path(__file__).resolve().parents[1] / "docker" / "grafana" / "dflash.json"
SERIES = re.compile(r"\bray_(dflash_\w+?)(_bucket|_sum|_count)?\b(\{[^}]*\})?")


@pytest.fixture(scope="module")
def labels() -> dict[str, set[str]]:
    """Metric name -> the labels the pool sets on it, read off the metric objects it creates."""
    from actors.pool_metrics import PoolMetrics

    metrics = [m for m in vars(PoolMetrics("r")).values() if hasattr(m, "_tag_keys")]
    return {m._name: set(m._tag_keys) for m in metrics}


def queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(panel title, expr, legendFormat) of every query, rows' nested panels included."""
    return [(p["title"], t["expr"], t.get("legendFormat", ""))
            for panel in dashboard["panels"] for p in [panel, *panel.get("panels", [])] for t in p.get("targets", [])]


def label_problems(expr: str, legend: str, labels: dict[str, set[str]]) -> list[str]:
    """Each label `expr` (and its legend) names that the metrics it reads do not carry."""
    bad, available = [], set()
    for name, suffix, matchers in SERIES.findall(expr):
        have = labels.get(name)
        if have is None and suffix:  # a counter named ..._count would be read as a suffix: try the full name
            have, name, suffix = labels.get(name + suffix), name + suffix, ""
        if have is None:
            bad.append(f"ray_{name}: not a metric the pool exports")
            continue
        have = have | ({"le"} if suffix == "_bucket" else set())
        available |= have
        bad += [f"ray_{name}{suffix} has no label {k!r}" for k in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers)
                if k not in have]
    grouped = [k.strip() for group in re.findall(r"\bby\s*\(([^)]*)\)", expr) for k in group.split(",") if k.strip()]
    bad += [f"by ({k}): no metric in the query carries it" for k in grouped if k not in available]
    outer = set(re.findall(r"^\s*\w+\s+by\s*\(([^)]*)\)", expr)[0].replace(" ", "").split(",")) \
        if re.match(r"^\s*\w+\s+by\s*\(", expr) else (available if not grouped else set())
    bad += [f"legend {{{{{k}}}}}: the query's result has no such label"
            for k in re.findall(r"\{\{\s*(\w+)\s*\}\}", legend) if k not in outer]
    return bad


def test_every_query_names_only_labels_the_pool_sets(labels):
    dashboard = json.loads(DASHBOARD.read_text())
    found = queries(dashboard)
    assert len(found) >= 11
    problems = {title: p for title, expr, legend in found if (p := label_problems(expr, legend, labels))}
    assert problems == {}
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        for metric, label in re.findall(r"label_values\(\s*ray_(dflash_\w+)\s*,\s*(\w+)\s*\)", text):
            assert label in labels[metric], (var["name"], text)


def test_the_labels_read_off_the_pool_are_its_tags(labels):
    assert labels["dflash_pool_items"] == {"run", "bucket"} and labels["dflash_jobs"] == {"run", "state"}
    assert labels["dflash_pull_wait_seconds"] == {"run"}  # waits are one histogram over all buckets


@pytest.mark.parametrize("expr, legend, problem", [
    ('max by (bucket) (ray_dflash_jobs{run="$run"})', "{{bucket}}", "by (bucket): no metric in the query carries it"),
    ('max(ray_dflash_pool_items{run="$run", drafter="0"})', "", "ray_dflash_pool_items has no label 'drafter'"),
    ('max by (state) (ray_dflash_jobs{run="$run"})', "{{target}}", "legend {{target}}: the query's result has no "
                                                                    "such label"),
    ('sum by (le) (rate(ray_dflash_served_total{run="$run"}[5m]))', "", "by (le): no metric in the query carries it"),
])
def test_a_wrong_label_is_caught(labels, expr, legend, problem):
    assert problem in label_problems(expr, legend, labels)


def test_the_dashboard_is_a_loadable_grafana_model():
    """What Grafana's import needs of each panel: a unique id, a type, a place on the 24-column grid, and
    queries with distinct refIds."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert isinstance(dashboard.get("schemaVersion"), int) and dashboard.get("title")
    panels = [p for panel in dashboard["panels"] for p in [panel, *panel.get("panels", [])]]
    ids = [p.get("id") for p in panels]
    assert all(isinstance(i, int) for i in ids) and len(set(ids)) == len(ids), ids
    for p in panels:
        grid = p.get("gridPos") or {}
        assert p.get("type") and {"h", "w", "x", "y"} <= set(grid), p.get("title")
        assert all(isinstance(grid[k], int) for k in "hwxy") and grid["x"] + grid["w"] <= 24, p["title"]
        refs = [t.get("refId") for t in p.get("targets", [])]
        assert all(refs) and len(set(refs)) == len(refs), p["title"]
