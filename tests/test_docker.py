"""The shipping files in docker/: they parse, agree with pyproject.toml, and the dashboard's queries
name exactly the metrics the application exports (app/metric_names.py). Fast, no Ray."""
from __future__ import annotations

import json
import re
import subprocess
import tomllib

import pytest
import yaml

from app import metric_names
from tests.helpers import ROOT

DOCKER = ROOT / "docker"
ENTRYPOINT = "python -m app.train --config conf/default.yaml"
AUTH_SECRET = "dflash-ray-auth"  # the Secret docker/README.md tells users to create
RAY_CONTROL_PORTS = {6379, 8265, 10001}  # GCS, dashboard (job API), Ray Client: whoever reaches them runs code
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


def _rayjob_docs() -> dict[str, dict]:
    """The documents of rayjob.yaml by kind (the RayJob and its NetworkPolicy)."""
    docs = [d for d in yaml.safe_load_all((DOCKER / "rayjob.yaml").read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    assert len(kinds) == len(docs), [d["kind"] for d in docs]
    return kinds


def _pod_templates(job: dict) -> dict[str, dict]:
    """Every pod the RayJob creates, by role: head, each worker group, the submitter."""
    cluster = job["spec"]["rayClusterSpec"]
    pods = {"head": cluster["headGroupSpec"]["template"], "submitter": job["spec"]["submitterPodTemplate"]}
    pods.update({f"worker {g['groupName']}": g["template"] for g in cluster["workerGroupSpecs"]})
    return pods


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


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


def test_dockerfile_installs_the_extras_it_is_given():
    """--build-arg EXTRAS=nixl must reach the dependency layer's pip install, and the default installs s3 and gs (boto3,
    google-auth: the exact run lease on an s3:// or gs:// checkpoint.dir), extras pyproject declares."""
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r'^ARG EXTRAS="s3,gs"$', text, re.M)
    pyproject = (DOCKER.parent / "pyproject.toml").read_text()
    assert re.search(r'^s3 = \["boto3', pyproject, re.M)
    assert re.search(r'^gs = \["google-auth', pyproject, re.M)
    dependency_install = re.search(r'pip install "(\.[^"]*)"', text)
    assert dependency_install, "the dependency layer does not install the project with its extras"
    spec = dependency_install.group(1)
    for extras, expected in (("", "."), ("s3", ".[s3]"), ("nixl", ".[nixl]")):
        shell = subprocess.run(["sh", "-c", f'EXTRAS="{extras}"; echo "{spec}"'], capture_output=True, text=True, check=True)
        assert shell.stdout.strip() == expected


def test_rayjob_is_a_kuberay_job_with_head_and_8_gpu_workers():
    job = _rayjob_docs()["RayJob"]
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


def test_every_pod_gets_ray_token_auth_from_the_secret():
    """Issue 22 item 13: head, workers and submitter all run with RAY_AUTH_MODE=token and the token from
    one Kubernetes Secret (never a literal in the manifest)."""
    pods = _pod_templates(_rayjob_docs()["RayJob"])
    assert {"head", "submitter"} < set(pods) and len(pods) >= 3
    for role, pod in pods.items():
        for container in pod["spec"]["containers"]:
            env = _env(container)
            assert env.get("RAY_AUTH_MODE") == {"name": "RAY_AUTH_MODE", "value": "token"}, (role, env)
            token = env.get("RAY_AUTH_TOKEN", {})
            assert "value" not in token, f"{role}: the token must come from the Secret, not the manifest"
            assert token.get("valueFrom") == {"secretKeyRef": {"name": AUTH_SECRET, "key": "auth_token"}}, (role, token)


def test_network_policy_admits_only_the_jobs_own_pods_to_the_ray_ports():
    """The job's pods reach each other; the operator, from its own namespace only (issue 35: any namespace
    was admitted), the dashboard; a named monitoring namespace the metrics port."""
    docs = _rayjob_docs()
    policy, pods = docs["NetworkPolicy"], _pod_templates(docs["RayJob"])
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector, "an empty podSelector would protect every pod of the namespace, not the job's"
    for role, pod in pods.items():  # the policy covers every pod the job creates
        assert selector.items() <= pod["metadata"]["labels"].items(), role
    assert "Ingress" in policy["spec"]["policyTypes"]
    rules = policy["spec"]["ingress"]
    own = [r for r in rules if r.get("from") == [{"podSelector": {"matchLabels": selector}}]]
    assert len(own) == 1 and "ports" not in own[0], "the job's pods must reach each other on every Ray port"
    for rule in rules:
        if rule in own:
            continue
        assert rule.get("from") and rule.get("ports"), f"{rule} admits every source or every port"
        ports = {p["port"] for p in rule["ports"]}
        operator = all(f.get("podSelector", {}).get("matchLabels") == {"app.kubernetes.io/name": "kuberay-operator"}
                       for f in rule["from"])
        # Only the operator may reach a control port (the dashboard, to poll the job); others get metrics.
        assert ports == {8265} if operator else not ports & RAY_CONTROL_PORTS, rule
        for source in rule["from"]:  # a namespace named by its name: a pod anywhere else cannot pose as one
            names = source.get("namespaceSelector", {}).get("matchLabels", {})
            assert names.get("kubernetes.io/metadata.name"), f"{source} admits pods of any namespace"


def test_nothing_binds_the_dashboard_to_all_interfaces_without_auth():
    job = _rayjob_docs()["RayJob"]
    cluster = job["spec"]["rayClusterSpec"]
    groups = {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}
    for name, group in groups.items():
        params = group.get("rayStartParams", {})
        if params.get("dashboard-host", "127.0.0.1") in ("0.0.0.0", "::"):
            for container in group["template"]["spec"]["containers"]:
                assert _env(container).get("RAY_AUTH_MODE", {}).get("value") == "token", name
        assert "ray-client-server-port" not in params, name
    assert "RAY_AUTH_MODE" not in job["spec"].get("runtimeEnvYAML", "")  # the pods' env decides, not the job's


def test_readme_creates_the_secret_the_job_reads():
    readme = (DOCKER / "README.md").read_text()
    assert f"kubectl create secret generic {AUTH_SECRET} --from-literal=auth_token=" in readme
    assert "RAY_AUTH_TOKEN=" in readme and "RAY_AUTH_MODE=token" in readme


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
