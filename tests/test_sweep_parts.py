"""The pure parts of a sweep (several drafter runs on one stream): a run's own layers out of the union
payload, the placement's drafter count, and the sweep summary's forwards per job."""
from __future__ import annotations

import numpy as np

from app.config.load import load_config
from app.config.sweep_section import sweep_root
from app.messages import HiddenBatch
from app.payload.layers import layer_columns, select_layers
from app.run.outputs.sweep_summary import flat_result, sweep_summary


def _batch(layers: int, width: int) -> HiddenBatch:
    hidden = np.concatenate([np.full((1, 3, width), layer, dtype=np.uint16) for layer in range(layers)], axis=-1)
    z = np.zeros((1, 3), dtype=np.int64)
    return HiddenBatch(7, hidden, "bfloat16", z, z.astype(np.uint8), np.array([3]))


def test_a_run_reads_its_own_layers_in_its_order_out_of_the_union():
    assert layer_columns([1, 3, 5], [1, 3, 5]) is None  # the same layers: the payload as it is
    cols = layer_columns([1, 3, 5], [5, 1])
    assert cols == [2, 0]
    got = select_layers(_batch(3, 4), cols, 3)
    assert got.hidden_BSD.shape == (1, 3, 8)
    assert got.hidden_BSD[0, 0].tolist() == [2] * 4 + [0] * 4  # layer 5's slice, then layer 1's


def test_the_placement_gives_every_run_its_ranks():
    cfg = load_config("conf/tiny-sweep.yaml")
    root = sweep_root(cfg)
    assert [r.drafters for r in root.runs] == [2, 2] and root.topology.num_drafters == 4
    one = load_config("conf/tiny.yaml")
    assert sweep_root(one) is one


def test_the_sweep_summary_counts_forwards_per_job():
    runs = {"a": {"tau_trained": 2.0, "tau_best": {"tau": 2.1}, "jobs_acked": 34}, "b": {"tau_trained": 1.5}}
    top = sweep_summary(runs, {"forwards": 36, "forwards_by_runs": {2: 34, 1: 2}}, 34, 34, 10.0)
    assert top["forwards_per_job"] == 1.0 and top["forwards_issued"] == 36
    assert top["forwards_by_runs_fed"] == {"1": 2, "2": 34}
    flat = flat_result(top)
    assert flat["a.tau_best"] == 2.1 and flat["b.tau_trained"] == 1.5 and flat["runs"] == 2


def test_the_chaos_rehearsal_of_a_sweep_paces_faults_on_every_run_s_step_log(tmp_path):
    from app.bench.runs import chaos

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"group_start": 0}\n' + '{"rank": 0, "step": 1}\n{"rank": 1, "step": 1}\n' * 3)
    b.write_text('{"group_start": 0}\n')
    state = chaos.ChaosState()
    assert chaos._wait_training(state, [a, b], need_starts=2, steps=3, timeout=0.2)  # a trained 3 steps
    assert not chaos._wait_training(state, [a, b], need_starts=3, steps=1, timeout=0.2)  # no third group start yet
    assert not chaos._wait_training(state, [a, b], need_starts=2, steps=1, after=[7, 1], timeout=0.2)  # none since
    b.write_text(b.read_text() + '{"group_start": 0}\n{"rank": 0, "step": 1}\n')  # b's group rebuilt and stepping
    assert chaos._wait_training(state, [a, b], need_starts=3, steps=1, after=[7, 1], timeout=0.2)


def test_the_sweep_report_shows_the_runs_side_by_side():
    from app.run.outputs.sweep_summary import render_sweep

    top = sweep_summary({"d1": {"tau_trained": 2.5}, "d2": {"tau_trained": 3.25, "tau_best": {"tau": 3.5}}},
                        {"forwards": 34}, 34, 34, 1.0)
    page = render_sweep(top, "tiny-sweep")
    assert page.count('<tr><td><a href="runs/') == 2 and "runs/d2/report.html" in page
    assert "<td>2.5</td>" in page and "<td>3.5</td>" in page and "34 target forwards (1 per job)" in page


def _plan(tmp_path, *overrides):
    from types import SimpleNamespace

    from app.config.checks import TargetInfo
    from app.data.schedule import ScheduledJobs
    from app.run.plan import RunPlan

    cfg = load_config("conf/tiny-sweep.yaml", [f"checkpoint.dir={tmp_path}", *overrides])
    data = SimpleNamespace(tokens=np.arange(8), loss_mask=np.ones(8, np.uint8), offsets=np.array([0, 8]))
    info = TargetInfo(num_layers=6, vocab_size=100, hidden_size=8, pad_token_id=0, eos_token_ids=(1,), mask_token_id=2)
    return RunPlan(cfg=sweep_root(cfg), model_dir="", info=info, layer_ids=[3], mask_token_id=2, dataset=data,
                   data_summary={}, jobs=ScheduledJobs([]), eval_prompts=[], resume_from=None, resume_step=0,
                   resume_ledger=[], total_steps=1)


def test_the_targets_capture_the_union_of_the_runs_layers_and_each_run_reads_its_own(tmp_path):
    from app.run.sweep import plan_runs

    plan = _plan(tmp_path)
    runs = plan_runs(plan)
    assert runs["depth1"].layer_ids == [3] and runs["depth2"].layer_ids == [1, 3]  # DFlash's default per depth
    assert plan.layer_ids == [1, 3] and runs["depth1"].feature_layer_ids == [1, 3]
    assert runs["depth1"].cfg.checkpoint.dir == f"{tmp_path}/runs/depth1" and runs["depth1"].resume_from is None


def test_a_run_reading_a_layer_the_target_lacks_is_refused_before_any_actor(tmp_path, capsys, monkeypatch):
    """The plan's target check refuses it (app/config/layer_checks.py, before ray.init), so `plan_runs`, which
    runs after it, has no range check of its own: `app.train.main` exits 2 with the one line."""
    import pytest
    import ray

    from app.train import main

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init before the layers were checked"))
    assert main(["--config", "conf/tiny-sweep.yaml", f"checkpoint.dir={tmp_path}",
                 "runs=[{name: a}, {name: deep, target_layer_ids: [1, 9]}]"]) == 2
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.strip() and "model shards" not in line]
    assert len(lines) == 1, lines
    assert "runs[deep].target_layer_ids=[1, 9] has 9, outside the target's 6 layers (0..5)" in lines[0], lines
