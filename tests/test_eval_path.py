"""One evaluation path: the end-of-run tau and the last evaluation during the run are the same code with the
same EvalSpec (EOS included), so `tau_trained` equals the last `tau_history` point for the same weights."""
from __future__ import annotations

import json
import math
import threading
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import app.model.spec_decode as sd
from app.config.checks import read_target_info
from app.config.load import load_config
from app.model.build import build_or_load_drafter
from app.model.export import export_drafter
from app.model.drafter_tau import evaluate_drafter, weights_to_numpy
from app.run.evaluate.schedule import EvalOffer
from app.run.outputs.monitor import RunMonitor
from app.run.outputs.run_outputs import RunOutputs
from app.run.run_supervisor import RunSupervisor
from tests.toy import LAYERS, PROMPTS, save_tiny_target

BUDGET = 24  # eval.max_new_tokens
CPU = torch.device("cpu")


def _target_that_emits_eos(path):
    """The seed-0 tiny target with its eos_token_id set to the 8th token of its own greedy answer to the
    last prompt: greedy decoding hits EOS well inside the budget."""
    model = save_tiny_target(path, seed=0)
    eos = sd.greedy_reference(model, PROMPTS[-1], BUDGET)[7]
    cfg_path = path / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "eos_token_id": eos}))
    return model, eos


def _plan(model_dir, tmp_path):
    cfg = load_config("conf/tiny.yaml", [f"checkpoint.dir={tmp_path / 'run'}", "drafter.num_layers=1",
                                         "drafter.block_size=4", "eval.num_prompts=3", f"eval.max_new_tokens={BUDGET}"])
    return SimpleNamespace(cfg=cfg, model_dir=str(model_dir), info=read_target_info(model_dir), layer_ids=LAYERS,
                           eval_prompts=PROMPTS, mask_token_id=3)


def _wired(plan):
    """The run's supervisor and the evaluation runner as the driver wires them (RunOutputs.attach), before start."""
    sup = RunSupervisor("", plan, monitor=RunMonitor(), stop=threading.Event(), log=lambda _: None)
    outputs = RunOutputs(plan.cfg, "run", sup.monitor, resumed_step=0, log=lambda _: None)
    outputs.attach(sup.plan, sup.eval_spec, sup.pool, sup.alive_targets)
    outputs.timeline.close()
    return sup, outputs.evals


@pytest.mark.slow
def test_end_of_run_tau_equals_the_last_live_tau_on_a_target_that_emits_eos(tmp_path):
    model_dir = tmp_path / "target"
    model, eos = _target_that_emits_eos(model_dir)
    hits = [sd.greedy_reference(model, p, BUDGET, eos) for p in PROMPTS]
    assert hits[-1][-1] == eos and len(hits[-1]) == 8 < BUDGET  # EOS really ends decoding inside the budget
    plan = _plan(model_dir, tmp_path)

    # The specs as the run wires them: the supervisor's for the end of the run, the one it hands the eval
    # runner (app/run/outputs/run_outputs.py) for the evaluations during it, with the target folder's EOS.
    sup, runner = _wired(plan)
    assert runner.spec is sup.eval_spec and sup.eval_spec.eos_token_id == eos

    # The final weights: rank 0's state dict (the last offer, live) and the exported drafter/ (end of run).
    drafter, head, arch = build_or_load_drafter(str(model_dir), None, plan.cfg.drafter, LAYERS, 3, CPU,
                                                torch.float32, seed=7)
    exported = str(export_drafter(drafter, arch, tmp_path / "drafter"))
    live, _, _ = evaluate_drafter(model, str(model_dir), LAYERS, 40, weights_to_numpy(drafter), runner.spec, CPU,
                                  torch.float32, references={})
    live_export, _, _ = evaluate_drafter(model, str(model_dir), LAYERS, 40, exported, runner.spec, CPU,
                                         torch.float32, references={})
    final, _, _ = evaluate_drafter(model, str(model_dir), LAYERS, 40, exported, sup.eval_spec, CPU, torch.float32,
                                   references={})
    assert final.matches_greedy and live.matches_greedy
    assert final.tau == live.tau == live_export.tau and final.per_pos_accept == live.per_pos_accept
    assert final.new_tokens == sum(len(h) for h in hits) < len(PROMPTS) * BUDGET  # EOS cut the decoding

    # The old end-of-run path decoded past EOS to the budget: a different tau for the same weights.
    old = sd.measure_tau(model, drafter.eval(), head, PROMPTS, BUDGET, LAYERS, arch.block_size)
    assert old.new_tokens == len(PROMPTS) * BUDGET
    assert old.tau != pytest.approx(final.tau)


@pytest.mark.parametrize("bad", [0.0, -5.0, math.inf, math.nan])
def test_eval_timeout_must_be_a_finite_positive_number_of_seconds(bad):
    cfg = load_config("conf/tiny.yaml", [])
    with pytest.raises(ValueError) as info:
        replace(cfg.eval, timeout_s=bad)
    assert str(info.value).startswith(f"eval.timeout_s={bad!r} must be a finite number of seconds > 0")
    assert "eval.timeout_s=900" in str(info.value) and "\n" not in str(info.value)


def test_one_eval_timeout_governs_the_live_schedule(tmp_path):
    """The live evaluation's overdue check reads eval.timeout_s (the end-of-run deadline is the same key)."""
    save_tiny_target(tmp_path / "target")
    plan = _plan(tmp_path / "target", tmp_path)
    plan.cfg = replace(plan.cfg, eval=replace(plan.cfg.eval, timeout_s=42.0))
    _, runner = _wired(plan)
    assert runner.schedule.timeout_s == 42.0 and runner.spec.eos_token_id is None  # the tiny target has no EOS
    runner.schedule.offer(EvalOffer(20, "weights"))
    runner.schedule.start({}, [0], now=100.0)
    assert not runner.schedule.overdue(142.0) and runner.schedule.overdue(142.5)
