"""The shipping files in docker/: they parse, agree with pyproject.toml, and the dashboard's queries
name exactly the metrics the application exports (app/pool/metric_names.py). Fast, no Ray."""
from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from app.pool import metric_names

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
ENTRYPOINT = "python -m app.train --config conf/default.yaml"
# Ray's Prometheus exporter prefixes custom metrics; histograms add these series suffixes.
RAY_PREFIX = "ray_"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
PROMQL_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def _pyproject_ray_version() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    found = [m.group(1) for d in deps if (m := re.fullmatch(r"ray\[default\]>=([0-9.]+)", d))]
    assert len(found) == 1, f"expected one 'ray[default]>=X' dependency, got {deps}"
    return found[0]


def _dockerfile_base_image() -> str:
    froms = [line.split()[1] for line in (DOCKER / "Dockerfile").read_text().splitlines()
             if line.strip().upper().startswith("FROM ")]
    assert len(froms) == 1, f"expected one FROM line, got {froms}"
    return froms[0]


def _dashboard() -> dict:
    return json.loads((DOCKER / "grafana" / "dflash.json").read_text())


def _panel_exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every query, rows' nested panels included."""
    out = []
    for panel in dashboard["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            out += [(p["title"], t["expr"]) for t in p.get("targets", [])]
    return out


def exported_metric(series: str) -> str | None:
    """The app metric a Prometheus series name stands for: `ray_dflash_x_bucket` -> `dflash_x`.
    None for names that are not dflash metrics (functions, labels, other Ray metrics)."""
    name = series.removeprefix(RAY_PREFIX)
    if not name.startswith("dflash_"):
        return None
    if name in metric_names.ALL:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def _metrics_in(expr: str) -> set[str]:
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    return {m for tok in PROMQL_NAME.findall(without_strings) if (m := exported_metric(tok))}


def test_exported_metric_strips_prefix_and_histogram_suffixes():
    assert exported_metric("ray_dflash_pull_wait_seconds_bucket") == "dflash_pull_wait_seconds"
    assert exported_metric("ray_dflash_pull_wait_seconds_count") == "dflash_pull_wait_seconds"
    assert exported_metric("ray_dflash_served_total") == "dflash_served_total"
    assert exported_metric("ray_dflash_nonsense") == "dflash_nonsense"
    assert exported_metric("histogram_quantile") is None
    assert exported_metric("ray_node_cpu_utilization") is None


def test_dockerfile_base_image_is_ray_image_of_pyproject_version():
    image = _dockerfile_base_image()
    repo, tag = image.split(":")
    assert repo == "rayproject/ray"
    version, python, platform = tag.split("-", 2)
    assert version == _pyproject_ray_version()
    assert python == "py311"
    assert platform == "gpu" or platform.startswith("cu"), f"{image} is not a CUDA image"


def test_dockerfile_installs_the_project():
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^RUN .*pip install (--no-deps )?\.", text, re.M)
    assert re.search(r"^WORKDIR /", text, re.M)
    for folder in ("app", "actors", "conf"):
        assert re.search(rf"^COPY .*\b{folder}\b", text, re.M), f"Dockerfile does not copy {folder}/"


def test_rayjob_is_a_kuberay_job_with_head_and_8_gpu_workers():
    job = yaml.safe_load((DOCKER / "rayjob.yaml").read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    assert spec["entrypoint"].startswith(ENTRYPOINT)
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == _pyproject_ray_version()
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    [workers] = cluster["workerGroupSpecs"]
    worker = workers["template"]["spec"]["containers"][0]
    assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) == 8
    assert "nvidia.com/gpu" not in head["resources"].get("limits", {})
    images = {head["image"], worker["image"], spec["submitterPodTemplate"]["spec"]["containers"][0]["image"]}
    assert len(images) == 1, f"head, workers and submitter must run one image, got {images}"


def test_prometheus_scrapes_ray_service_discovery_file():
    conf = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    [job] = conf["scrape_configs"]
    files = [f for sd in job["file_sd_configs"] for f in sd["files"]]
    assert files == ["/tmp/ray/prom_metrics_service_discovery.json"]


def test_every_panel_query_names_a_known_metric():
    exprs = _panel_exprs(_dashboard())
    assert len(exprs) >= 11
    for title, expr in exprs:
        used = _metrics_in(expr)
        assert used, f"panel {title!r}: {expr!r} names no dflash metric"
        unknown = used - set(metric_names.ALL)
        assert not unknown, f"panel {title!r} queries {unknown}, not in app/pool/metric_names.ALL"


def test_every_exported_metric_has_a_panel():
    used = set().union(*(_metrics_in(e) for _, e in _panel_exprs(_dashboard())))
    assert set(metric_names.ALL) - used == set()


def test_every_query_is_filtered_by_run_and_uses_the_datasource_variable():
    dashboard = _dashboard()
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "run"} <= names
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for t in panel["targets"]:
            # Each metric selector, not just one per query: a histogram_quantile over unfiltered
            # buckets would mix two runs.
            selectors = re.findall(r"ray_dflash_\w+(\{[^}]*\})?", t["expr"])
            assert selectors and all('run="$run"' in s for s in selectors), (panel["title"], t["expr"])


@pytest.mark.parametrize(
    "series, unknown",
    [("ray_dflash_pool_itemz", "dflash_pool_itemz"), ("dflash_train_losses", "dflash_train_losses")],
)
def test_unknown_metric_would_be_caught(series, unknown):
    assert _metrics_in(f'max({series}{{run="$run"}})') - set(metric_names.ALL) == {unknown}
