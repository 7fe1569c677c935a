"""The pre-flight (app/run/preflight.py): every check against the cluster runs before any actor, in order, and
a mistake is one ConfigError naming the setting. No Ray: the cluster is what Ray would have said."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from app.config.errors import ConfigError
from app.config.load import load_config
from app.run.preflight import Cluster, check_dir_shared, preflight
from tests.helpers import ROOT


def _node(cpus: float) -> dict:
    return {"Alive": True, "NodeID": "n0", "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": cpus}}


def _plan(tmp_path: Path, seen: list[str]) -> SimpleNamespace:
    """A plan that records what the pre-flight asks of it (sizing the jobs for the device comes third)."""
    cfg = load_config(ROOT / "conf/tiny.yaml", [f"checkpoint.dir={tmp_path}"])

    def use_device(on_gpu: bool) -> None:
        seen.append(f"use_device({on_gpu})")
        raise ConfigError("one global step does not fit (stand-in)")

    return SimpleNamespace(cfg=cfg, use_device=use_device)


def test_a_cluster_too_small_is_refused_before_the_jobs_are_sized(tmp_path: Path) -> None:
    seen: list[str] = []
    plan = _plan(tmp_path, seen)
    small = Cluster({"CPU": 1.0, "memory": 64e9, "object_store_memory": 8e9}, [_node(1.0)], use_gpu=False)
    with pytest.raises(ConfigError, match=r"topology asks for [\d.]+ CPUs .* but the cluster has 1; lower them"):
        preflight(plan, small)
    assert seen == []  # the resources came first: nothing else was asked


def test_a_cluster_that_fits_goes_on_to_size_the_jobs(tmp_path: Path) -> None:
    seen: list[str] = []
    plan = _plan(tmp_path, seen)
    big = Cluster({"CPU": 64.0, "memory": 64e9, "object_store_memory": 8e9}, [_node(64.0)], use_gpu=False)
    with pytest.raises(ConfigError, match="stand-in"):
        preflight(plan, big)
    assert seen == ["use_device(False)"]  # resources and placement passed; then the step's bytes


def test_a_relative_checkpoint_dir_on_a_joined_cluster_is_refused(tmp_path: Path, monkeypatch) -> None:
    cfg = load_config(ROOT / "conf/tiny.yaml", ["checkpoint.dir=runs/exp"])
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.raises(ConfigError, match=r"checkpoint.dir='runs/exp' is relative"):
        check_dir_shared(cfg)
    monkeypatch.setenv("RAY_ADDRESS", "local")  # a local cluster: one working dir, fine
    check_dir_shared(cfg)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    check_dir_shared(load_config(ROOT / "conf/tiny.yaml", [f"checkpoint.dir={tmp_path}"]))  # absolute: fine


def test_a_sweeps_jobs_are_sized_for_the_union_of_its_runs_layers(tmp_path: Path) -> None:
    """The targets capture every layer any run reads: a job's payload, the pool's byte budget and the drafters'
    staging buffers are that size. Before, the jobs were sized for model.target_layer_ids alone, then the union
    was taken (a run reading three layers where the root reads one: payloads three times the estimate)."""
    import numpy as np

    from app.config.checks import TargetInfo
    from app.config.sweep_section import sweep_root
    from app.data.schedule import ScheduledJobs
    from app.run.plan import RunPlan, bytes_per_token

    cfg = sweep_root(load_config(ROOT / "conf/tiny-sweep.yaml", [
        f"checkpoint.dir={tmp_path}", "runs=[{name: a, target_layer_ids: [3]}, {name: wide, target_layer_ids: [0, 1, 3]}]"]))
    info = TargetInfo(num_layers=6, vocab_size=100, hidden_size=8, pad_token_id=0, eos_token_ids=(1,), mask_token_id=2)
    data = SimpleNamespace(tokens=np.arange(8), loss_mask=np.ones(8, np.uint8), offsets=np.array([0, 8]))
    plan = RunPlan(cfg=cfg, model_dir="", info=info, layer_ids=[3], mask_token_id=2, dataset=data, data_summary={},
                   jobs=ScheduledJobs([]), eval_prompts=[], resume_from=None, resume_step=0, resume_ledger=[],
                   total_steps=1)
    cluster = Cluster({"CPU": 64.0, "memory": 64e9}, [_node(64.0)], use_gpu=False)
    runs = preflight(plan, cluster)
    union = bytes_per_token(cfg, info, [0, 1, 3], on_gpu=False)
    assert plan.layer_ids == [0, 1, 3] and union > bytes_per_token(cfg, info, [3], on_gpu=False)
    assert plan.bytes_per_token == runs["a"].bytes_per_token == runs["wide"].bytes_per_token == union
    assert plan.jobs.est_bytes_per_token == union  # what every job's JobSpec.est_bytes is computed from
