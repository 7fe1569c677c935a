"""The learning checks catch what they name: each fault injected into a small run or a drafter on the tiny
target is flagged by its verdict, and a healthy tiny run is flagged healthy (app/model/health.py).

The slow tests share one in-process run of the markov demo (conf/tiny.yaml's budget, 6 epochs, seed 0:
`app.bench.runs.quality.train_in_process`, about 30 s of one CPU) and inject each fault at evaluation, as a
user's wiring would: a random LM head, the drafter read with every target layer id + 1, its features zeroed.
The frozen drafter is a small run of its own (no learning rate). Each prints its verdict lines (pytest -s).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from app.config.health_section import HealthConfig
from app.data.dataset import DataSummary, TokenizedDataset
from app.model.health import (Health, collapse, fit_sample, other_tokens, pos1, spread, status_word, verdicts)

CFG = HealthConfig()
HEALTHY = Health(step=100, tau=5.0, tau_fit=5.3, tau_replay=5.0, tau_no_features=1.1, tau_layers_below=4.2,
                 tau_layers_above=4.9, head_is_target=True, first_distinct=46, first_top_share=0.04,
                 target_top_share=0.02, anchor_changed=0.0, pos1=0.94, anchors=376, seconds=1.0, pos1_loss=0.81,
                 pos1_loss_below=0.88, pos1_loss_above=0.86)


def _names(h: Health, cfg: HealthConfig = CFG) -> list[str]:
    return [v.name for v in verdicts(h, cfg)]


def test_each_figure_gives_its_own_verdict_and_a_healthy_one_none():
    assert _names(HEALTHY) == [] and status_word(verdicts(HEALTHY, CFG)) == "ok"
    # A healthy drafter that reads its anchor from the features (pos1 high) is not flagged for ignoring it.
    assert _names(replace(HEALTHY, anchor_changed=0.0, pos1=0.9)) == []
    assert _names(replace(HEALTHY, head_is_target=False)) == ["head_not_target"]
    assert _names(replace(HEALTHY, tau_layers_below=5.2)) == []  # tau next door alone: a block or two of noise
    assert _names(replace(HEALTHY, pos1_loss_below=0.80)) == []  # within health.layer_loss_margin
    assert _names(replace(HEALTHY, pos1_loss_above=0.76)) == ["layers_off"]
    assert _names(replace(HEALTHY, tau_fit=1.1)) == ["not_fitting"]
    assert _names(replace(HEALTHY, first_top_share=0.6)) == ["collapsed"]
    assert _names(replace(HEALTHY, first_top_share=0.6, target_top_share=0.7)) == []  # the text is that repetitive
    assert _names(replace(HEALTHY, tau_no_features=4.95)) == ["ignoring_features"]
    assert _names(replace(HEALTHY, anchor_changed=0.1, pos1=0.3)) == ["ignoring_anchor"]
    assert _names(replace(HEALTHY, tau_fit=6.5)) == ["overfitting"]
    stuck = replace(HEALTHY, tau=1.0, tau_fit=1.0, tau_replay=1.0, tau_no_features=1.0, tau_layers_below=1.0,
                    tau_layers_above=1.0, first_distinct=1, first_top_share=1.0, pos1=0.0)
    assert _names(stuck) == ["not_fitting", "collapsed", "ignoring_features", "ignoring_anchor"]
    assert status_word(verdicts(stuck, CFG)) == "not_fitting+3"
    assert _names(replace(stuck, step=10)) == []  # before health.after_steps: a drafter at init fails them all
    assert _names(replace(stuck, tau_fit=None)) == _names(stuck)  # no training sample: held-out tau is judged


def test_first_guess_figures_count_what_they_say():
    assert collapse([7, 7, 7, 2]) == collapse([2, 7, 7, 7])
    c = collapse([7, 7, 7, 2])
    assert (c.guesses, c.distinct, c.top_share, c.top_token) == (4, 2, 0.75, 7)
    assert pos1([5, 9, 1], tokens=[4, 5, 6, 9, 2], anchors=[0, 2, 3]) == pytest.approx(2 / 3)
    swapped = other_tokens([3, 3, 4, 5, 3])
    assert all(a != b for a, b in zip([3, 3, 4, 5, 3], swapped))  # never the anchor's own token
    assert set(swapped) <= {3, 4, 5} and other_tokens([8, 8]) == [8, 8]  # nothing to swap in: unchanged
    assert spread(3, 10, 4) == [3, 5, 8, 10] and spread(3, 4, 64) == [3, 4] and spread(5, 4, 3) == []


def test_fit_sample_takes_each_sequences_prompt_and_first_response():
    seqs = [([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 0, 1]), ([7, 8, 9], [1, 1, 1]), ([10, 11, 12, 13], [0, 1, 1, 1])]
    tokens = np.concatenate([np.array(t) for t, _ in seqs])
    mask = np.concatenate([np.array(m) for _, m in seqs])
    offsets = np.cumsum([0] + [len(t) for t, _ in seqs])
    data = TokenizedDataset(tokens, mask, offsets, DataSummary())
    # The second sequence has no prompt (its mask starts on), so it is left out; the budget cuts the third.
    assert fit_sample(data, 3, max_new_tokens=2) == [([1, 2], [3, 4]), ([10], [11, 12])]
    assert fit_sample(data, 3, max_new_tokens=8)[0] == ([1, 2], [3, 4])  # the first response ends at the mask


@pytest.mark.slow
def test_a_frozen_drafter_is_flagged_not_fitting_and_collapsed(tmp_path):
    """A small run with no learning rate to speak of (train.lr 1e-12): the drafter stays at init."""
    run, spec = _train(tmp_path, ["train.epochs=1", "train.lr=1e-12"])
    health = _check(run, spec, run.drafter, run.head, HealthConfig(after_steps=0))
    assert {"not_fitting", "collapsed"} <= set(health["names"])
    assert health["tau_fit"] == pytest.approx(1.0, abs=0.05) and health["first_distinct"] <= 2


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The markov demo trained in this process (seed 0, 6 epochs): (run, spec)."""
    return _train(tmp_path_factory.mktemp("health-demo"), [])


@pytest.mark.slow
def test_a_healthy_tiny_run_is_flagged_healthy(demo):
    run, spec = demo
    health = _check(run, spec, run.drafter, run.head)
    assert health["names"] == [] and health["status"] == "ok"
    assert health["tau"] > 3.7 and health["tau_fit"] > 3.7  # the quality test's floor (tests/test_quality.py)
    assert health["tau_replay"] == pytest.approx(health["tau"])  # the replay counts what speculative decoding got
    assert health["tau"] - health["tau_no_features"] > 1.0 and health["first_distinct"] > 20
    assert health["head_is_target"] is True


@pytest.mark.slow
def test_a_random_lm_head_is_flagged(demo):
    from app.model.target_head import TargetHead

    run, spec = demo
    torch.manual_seed(0)
    head = TargetHead(run.head.embed_tokens.weight.detach().clone(), torch.randn_like(run.head.lm_head.weight) * 0.02)
    health = _check(run, spec, run.drafter, head)
    assert health["names"][:2] == ["head_not_target", "not_fitting"]
    assert health["tau"] < 1.1 and health["pos1"] < 0.05


@pytest.mark.slow
def test_target_layer_ids_off_by_one_between_training_and_evaluation_are_flagged(demo):
    from app.model.build import build_or_load_drafter

    run, spec = demo
    off = [i + 1 for i in run.arch.target_layer_ids]
    drafter, head, _ = build_or_load_drafter(run.plan.model_dir, None, spec.drafter, off, run.plan.mask_token_id,
                                             torch.device("cpu"), torch.float32, 0)
    drafter.load_state_dict(run.drafter.state_dict())
    health = _check(run, spec, drafter.eval(), head)
    assert health["names"] == ["layers_off"]
    assert health["pos1_loss_below"] < health["pos1_loss"] * (1 - CFG.layer_loss_margin)  # the trained layers read better


@pytest.mark.slow
def test_zeroed_features_are_flagged(demo):
    run, spec = demo
    run.drafter.zero_features = True
    try:
        health = _check(run, spec, run.drafter, run.head)
    finally:
        run.drafter.zero_features = False
    assert "ignoring_features" in health["names"] and "not_fitting" in health["names"]
    assert health["tau_replay"] == pytest.approx(health["tau_no_features"])


def _train(work, overrides):
    from app.bench.runs.quality import corpus_config, train_in_process

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes; more threads run slower on a shared box
    try:
        cfg = corpus_config("markov", 0, work / "run", overrides)
        run = train_in_process(cfg)
    finally:
        torch.set_num_threads(threads)
    from app.model.drafter_tau import stop_token
    from app.run.evaluate.schedule import eval_spec

    return run, eval_spec(run.plan, stop_token(run.plan.info.eos_token_ids))  # the run's own spec, training sample too


def _check(run, spec, drafter, head, cfg: HealthConfig = CFG) -> dict:
    """The run's own evaluation (`check_health` after `measure_spec`, as evaluate_drafter runs them) at the
    run's last step; prints the status word, the figures and each verdict line."""
    from app.model.drafter_tau import check_health, measure_spec

    spec = replace(spec, health=cfg)
    references: dict = {}
    res = measure_spec(run.target, drafter, head, drafter.arch, spec, references)
    health = check_health(run.target, drafter, head, spec, references, len(run.losses), float(res.tau))
    print(f"health {health['status']}: tau {health['tau']:.2f} fit {health['tau_fit']:.2f} "
          f"no-features {health['tau_no_features']:.2f} first guesses {health['first_distinct']} distinct "
          f"(top {health['first_top_share']:.0%}) anchor {health['anchor_changed']:.0%} pos1 {health['pos1']:.0%}")
    for line in health["verdicts"]:
        print("  " + line)
    return health


def test_the_checks_replay_the_decoded_tau_and_keep_the_targets_features(tiny_target):
    """On the toy target with a drafter of random weights: the replayed tau equals the one speculative decoding
    counted, and a FeatureCache spares every target forward of a second evaluation (none when it holds nothing)."""
    import app.model.spec_decode as sd
    from app.config.drafter_sections import DrafterConfig
    from app.model.build import build_or_load_drafter
    from app.model.health import FeatureCache, measure_health

    model, path = tiny_target
    drafter, head, arch = build_or_load_drafter(str(path), None, DrafterConfig(num_layers=1, block_size=4), [0, 2], 3,
                                                torch.device("cpu"), torch.float32, seed=7)
    prompts = [[5, 9, 17, 2], [100, 3], [7, 7, 7, 7, 7, 7, 40]]
    with torch.no_grad():
        res = sd.measure_tau(model, drafter.eval(), head, prompts, 12, [0, 2], 4)
        heldout = [(p, sd.greedy_reference(model, p, 12)) for p in prompts]
    forwards = []
    hook = model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        cache, fit = FeatureCache(), [([5, 9], [17, 2, 8, 8])]
        first = measure_health(model, drafter, head, 100, res.tau, heldout, fit, 12, cache)
        n_first = len(forwards)
        again = measure_health(model, drafter, head, 100, res.tau, heldout, fit, 12, cache)
        n_again = len(forwards) - n_first
        measure_health(model, drafter, head, 100, res.tau, heldout, fit, 12, FeatureCache(max_bytes=0))
        n_uncached = len(forwards) - n_first - n_again
    finally:
        hook.remove()
    assert first.tau_replay == pytest.approx(res.tau)  # the replay counts what decoding got
    assert (n_first, n_again, n_uncached) == (4, 0, 4)  # one forward per held-out prompt and fit sequence
    assert replace(again, seconds=0.0) == replace(first, seconds=0.0)
    assert first.tau_layers_below is None and first.tau_layers_above is not None  # layer 0 has none below
    assert first.head_is_target is True and first.anchors == sum(len(g) - 1 for _, g in heldout)
