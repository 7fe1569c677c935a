"""Evaluation during the run, the target's side: weights from the object store in, tau out, best exported."""
from __future__ import annotations

import json

import pytest
import torch

import app.model.spec_decode as sd
from app.config.drafter_sections import DrafterConfig
from app.config.run_sections import EvalConfig
from app.model.build import build_or_load_drafter
from app.model.drafter_tau import (META_KEY, EvalSpec, copy_as_best, evaluate_drafter, export_best,
                                   per_position_acceptance, read_best_meta, weights_to_numpy)
from tests.toy import LAYERS, PROMPTS

DCFG = DrafterConfig(num_layers=1, block_size=4)
ECFG = EvalConfig(num_prompts=3, max_new_tokens=12)
SPEC = EvalSpec(PROMPTS, DCFG, ECFG, mask_token_id=3, seed=0, eos_token_id=None)


@pytest.fixture(scope="module")
def target(tiny_target):
    model, path = tiny_target
    return model, str(path)


def _trained_like(model_dir: str, seed: int):
    """A drafter whose weights differ from the seed-0 fresh one (as rank 0's would after steps)."""
    drafter, head, arch = build_or_load_drafter(model_dir, None, DCFG, LAYERS, 3, torch.device("cpu"),
                                                torch.float32, seed)
    return drafter.eval(), head, arch


def test_per_position_acceptance_counts_accepted_drafts():
    # tokens per forward 1, 3, 2, 4 -> accepted drafts 0, 2, 1, 3 (block of 4: positions 1..3)
    assert per_position_acceptance([1, 3, 2, 4], 4) == [0.75, 0.5, 0.25]
    assert per_position_acceptance([], 4) == [0.0, 0.0, 0.0]


@pytest.mark.slow
def test_weights_from_the_object_store_give_the_drafters_own_tau(target, tmp_path):
    model, model_dir = target
    drafter, head, arch = _trained_like(model_dir, seed=7)
    direct = sd.measure_tau(model, drafter, head, PROMPTS, ECFG.max_new_tokens, LAYERS, arch.block_size)
    live, rebuilt, _ = evaluate_drafter(model, model_dir, LAYERS, 40, weights_to_numpy(drafter), SPEC,
                                        torch.device("cpu"), torch.float32)
    assert live.matches_greedy and live.step == 40
    assert live.tau == pytest.approx(direct.tau)  # seed 0 built it, the state dict made it rank 0's drafter
    # E[accepted drafts] = sum over k of P(accepted >= k) = tau - 1 (tau counts the target's own token).
    assert sum(live.per_pos_accept) == pytest.approx(direct.tau - 1)
    # Exported as the best, then evaluated from the folder (what python -m app.evaluate does): same tau.
    best = export_best(rebuilt, arch, tmp_path / "drafter-best", step=40, tau=live.tau)
    assert read_best_meta(best) == {"step": 40, "tau": live.tau}
    again, _, _ = evaluate_drafter(model, model_dir, LAYERS, 40, str(best), SPEC, torch.device("cpu"), torch.float32)
    assert again.tau == live.tau and again.per_pos_accept == live.per_pos_accept


@pytest.mark.slow
def test_best_export_replaces_the_folder_whole(target, tmp_path):
    _, model_dir = target
    drafter, _, arch = _trained_like(model_dir, seed=1)
    out = tmp_path / "drafter-best"
    export_best(drafter, arch, out, step=20, tau=1.5)
    export_best(drafter, arch, out, step=60, tau=2.5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter-best"]  # no temp or old folder left
    assert json.loads((out / "config.json").read_text())[META_KEY] == {"step": 60, "tau": 2.5}
    copy_as_best(out, tmp_path / "copy", step=80, tau=3.0)
    assert read_best_meta(tmp_path / "copy") == {"step": 80, "tau": 3.0}
    assert (tmp_path / "copy" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_cpu_evaluation_runs_in_the_idle_class_and_restores_it():
    import os
    import threading

    from app.model.drafter_tau import background_priority

    tid = threading.get_native_id()
    before = (os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid))
    with background_priority(torch.device("cpu")):
        inside = os.sched_getscheduler(tid)
    assert inside == os.SCHED_IDLE
    assert (os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)) == before  # root can restore
    with background_priority(torch.device("meta")):  # not CPU: untouched
        assert os.sched_getscheduler(tid) == before[0]
