"""conf/tiny-sweep.yaml end to end: two drafter runs on one stream of target features (issue 38)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e_helpers import tiny_overrides
from tests.helpers import ROOT

pytestmark = [pytest.mark.ray, pytest.mark.slow]

RUNS = "runs=[{name: depth1, drafters: 1, drafter: {num_layers: 1}}, {name: depth2, drafters: 1, drafter: {num_layers: 2}}]"


def test_two_runs_on_one_stream_train_every_job_once_from_one_forward_each(ray_cluster, tmp_path: Path) -> None:
    from app.config.load import load_config
    from app.run.driver import run
    from app.training.step_log import FILE_NAME, count_trained

    cfg = load_config(ROOT / "conf/tiny-sweep.yaml", tiny_overrides(
        tmp_path, "topology.num_targets=2", "train.epochs=1", "eval.every_steps=10", "eval.race_prompts=0", RUNS))
    assert run(cfg) == 0
    top = json.loads((tmp_path / "summary.json").read_text())
    jobs = top["jobs_scheduled"]
    assert jobs > 0
    assert top["target_forwards"] == jobs and top["forwards_per_job"] == 1.0  # the targets' own counters
    assert top["forwards_by_runs_fed"] == {"2": jobs}  # every forward fed both runs
    assert set(top["runs"]) == {"depth1", "depth2"}
    for name in ("depth1", "depth2"):
        run_dir = tmp_path / "runs" / name
        counts = count_trained(run_dir / FILE_NAME).count(jobs, 0)  # from the run's own step records
        assert counts == {"trained_once": jobs, "trained_twice": 0, "never_trained": 0}, name
        own = json.loads((run_dir / "summary.json").read_text())
        assert own["drafter_run"] == name and own["jobs_acked"] == jobs and own["jobs_acked_twice"] == 0
        assert own["tau_trained"] is not None and top["runs"][name]["tau_trained"] == own["tau_trained"]
        # tau during the run too, on a drafter of the run's own depth and layers (the targets capture both runs')
        assert len(own["tau_history"]) >= 2 and own["tau_history"][0][0] < own["steps"], own["tau_history"]
        arch = json.loads((run_dir / "drafter" / "config.json").read_text())
        assert arch["num_hidden_layers"] == int(name[-1])  # each run exported its own depth
