"""Speculative decoding reproduces the target's greedy output, whatever the drafter proposes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import app.model.spec_decode as sd
from app.model.drafter import DFlashDrafter
from app.model.features import target_features
from app.model.loss import TrainBatch, dflash_loss
from app.model.target_head import TargetHead
from tests.toy import LAYERS, PROMPTS, tiny_arch

B = 4



@pytest.fixture(scope="module")
def target(tiny_target):
    model, path = tiny_target
    return model, TargetHead.load(path), path


def _drafter(model, seed=0):
    torch.manual_seed(seed)
    return DFlashDrafter(tiny_arch(model.config, block_size=B, target_layer_ids=LAYERS)).eval()


@pytest.mark.parametrize("use_cache", [True, False])
def test_random_drafter_matches_greedy_and_tau_near_one(target, use_cache):
    model, head, _ = target
    drafter = _drafter(model)
    ev = sd.measure_tau(model, drafter, head, PROMPTS, 16, LAYERS, B, use_cache=use_cache)
    res = sd.spec_generate(model, drafter, head, PROMPTS[0], 16, LAYERS, B, use_cache=use_cache)
    assert sum(res.accepted_per_forward) == len(res.tokens) - 1  # the prefill made the first
    assert ev.matches_greedy and 1.0 <= ev.tau < 1.3


def test_cached_greedy_references_skip_decoding_but_still_check(target, monkeypatch):
    """Evaluations during a run keep the frozen target's greedy outputs: the second call decodes no
    reference, gives the same tau, and a wrong cached reference is still caught."""
    model, head, _ = target
    drafter = _drafter(model)
    refs: dict = {}
    first = sd.measure_tau(model, drafter, head, PROMPTS, 16, LAYERS, B, references=refs)
    assert len(refs) == len(PROMPTS) and first.greedy_tok_s > 0 and first.matches_greedy
    calls = []
    real = sd.greedy_reference
    monkeypatch.setattr(sd, "greedy_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
    second = sd.measure_tau(model, drafter, head, PROMPTS, 16, LAYERS, B, references=refs)
    assert calls == [] and second.tau == first.tau and second.matches_greedy and second.greedy_tok_s == 0
    key = next(iter(refs))
    refs[key] = [t + 1 for t in refs[key]]
    assert not sd.measure_tau(model, drafter, head, PROMPTS, 16, LAYERS, B, references=refs).matches_greedy


def _drifted(refs: dict, prompt: list[int], at: int) -> None:
    """Make the cached greedy reference of `prompt` differ from position `at` on: what a bf16 near-tie
    flip between the one-token reference and the multi-token verify looks like on a GPU."""
    key = next(k for k in refs if list(k[0]) == prompt)
    refs[key] = refs[key][:at] + [(t + 1) % 128 for t in refs[key][at:]]


def test_a_greedy_drift_fails_an_fp32_cpu_target_but_is_only_reported_where_kernels_differ(target, monkeypatch):
    """Item 5 of issue 23: bf16 on a GPU flips near-ties between verify and the one-token reference;
    that is reported (mismatch rate, first divergence), not failed on. The fp32 CPU check stays exact."""
    model, head, _ = target
    drafter = _drafter(model)
    refs: dict = {}
    clean = sd.measure_tau(model, drafter, head, PROMPTS, 16, LAYERS, B, references=refs)
    assert clean.exact and clean.lossless and clean.mismatch_rate == 0 and clean.first_divergence == -1
    _drifted(refs, PROMPTS[1], at=3)
    cpu = sd.measure_tau(model, drafter, head, PROMPTS, 16, LAYERS, B, references=refs)
    assert cpu.exact and not cpu.matches_greedy and not cpu.lossless  # fp32 on CPU: exact, so a failure
    assert cpu.mismatch_rate == pytest.approx(1 / 3) and cpu.first_divergence == 3 and cpu.acceptance_errors == 0
    assert cpu.verify_mismatches == 16 - 3 and cpu.verify_share == pytest.approx(13 / cpu.verify_tokens)
    monkeypatch.setattr(sd, "exact_arithmetic", lambda m: False)  # as a bf16 target on a GPU
    gpu = sd.measure_tau(model, drafter, head, PROMPTS, 16, LAYERS, B, references=refs)
    assert not gpu.exact and not gpu.matches_greedy and gpu.lossless
    assert gpu.mismatch_rate == pytest.approx(1 / 3) and gpu.first_divergence == 3


def test_an_acceptance_bug_fails_whatever_the_arithmetic(target, monkeypatch):
    """Keeping a draft the verify forward's own argmax rejects is a real bug, on a GPU too."""
    model, head, _ = target
    real = sd.accepted_prefix
    monkeypatch.setattr(sd, "accepted_prefix", lambda d, g: min(len(d), real(d, g) + 1))  # one too many
    monkeypatch.setattr(sd, "exact_arithmetic", lambda m: False)
    ev = sd.measure_tau(model, _drafter(model), head, PROMPTS, 16, LAYERS, B)
    assert ev.acceptance_errors > 0 and ev.verify_mismatches > 0 and not ev.lossless


@pytest.mark.parametrize("broken", ["none", "accept_a_wrong_draft", "stale_cache"])
def test_verify_mismatches_count_tokens_off_the_targets_own_greedy_output(target, monkeypatch, broken):
    """Issue 37: verify_mismatches compares the speculative output with plain greedy decoding token for token.
    A verify path that is wrong yet agrees with itself (rejected drafts left in the KV cache: every later
    verify forward attends to them) has no acceptance error; only the comparison with greedy sees it."""
    model, head, _ = target
    if broken == "accept_a_wrong_draft":
        real = sd.accepted_prefix
        monkeypatch.setattr(sd, "accepted_prefix", lambda d, g: min(len(d), real(d, g) + 1))
    elif broken == "stale_cache":
        monkeypatch.setattr(sd._TargetRunner, "keep", lambda self, length: None)
    ev = sd.measure_tau(model, _drafter(model), head, PROMPTS, 16, LAYERS, B)
    assert ev.exact and ev.verify_tokens >= 16 * len(PROMPTS)
    if broken == "none":
        assert ev.verify_mismatches == 0 and ev.verify_share == 0 and ev.lossless
        return
    assert ev.verify_mismatches > 0 and 0 < ev.verify_share <= 1 and not ev.lossless
    assert (ev.acceptance_errors > 0) == (broken == "accept_a_wrong_draft")
    monkeypatch.setattr(sd, "exact_arithmetic", lambda m: False)  # bf16 on a GPU: the share is reported
    gpu = sd.measure_tau(model, _drafter(model), head, PROMPTS, 16, LAYERS, B)
    assert gpu.verify_mismatches == ev.verify_mismatches and gpu.lossless == (broken == "stale_cache")


def _oracle(model, correct: int):
    """A draft_block stand-in that knows the target's greedy continuation for `correct` tokens."""

    def draft(drafter, head, context, anchor_token, block_size):
        # context holds the features of every position before the anchor: recover the ids.
        ids = draft.ids[: context.shape[0] + 1]
        assert ids[-1] == anchor_token
        cont = sd.greedy_reference(model, ids, block_size - 1, use_cache=False)
        return cont[:correct] + [(t + 1) % 128 for t in cont[correct:]]

    return draft


@pytest.mark.parametrize("correct,tau", [(B - 1, B), (2, 3), (0, 1)])
def test_forced_drafts_are_accepted_exactly(target, monkeypatch, correct, tau):
    model, head, _ = target
    prompt = PROMPTS[0]
    ref = sd.greedy_reference(model, prompt, 21)
    assert ref == sd.greedy_reference(model, prompt, 21, use_cache=False)
    oracle = _oracle(model, correct)
    oracle.ids = prompt + ref
    monkeypatch.setattr(sd, "draft_block", oracle)
    res = sd.spec_generate(model, _drafter(model), head, prompt, 21, LAYERS, B)
    assert res.tokens == ref
    assert res.accepted_per_forward == [tau] * (20 // tau) + ([20 % tau] if 20 % tau else [])


def test_stops_at_eos(target):
    model, head, _ = target
    ref = sd.greedy_reference(model, PROMPTS[0], 30)
    eos = ref[5]
    want = ref[: ref.index(eos) + 1]
    assert sd.greedy_reference(model, PROMPTS[0], 30, eos) == want
    assert sd.spec_generate(model, _drafter(model), head, PROMPTS[0], 30, LAYERS, B, eos).tokens == want


@pytest.mark.slow
def test_trained_drafter_is_accepted_and_still_matches_greedy(target):
    """Train on the target's own greedy continuations; the same prompts then draft well.

    This ties training to inference: with shifted labels every draft lands one slot off and tau
    stays near 1. (The `<=` mask bug is not caught here: three memorised sequences give the drafter
    other cues; the mask tests catch it.)
    """
    model, head, _ = target
    seqs = [p + sd.greedy_reference(model, p, 40) for p in PROMPTS]
    S = max(map(len, seqs))
    ids = torch.zeros(len(seqs), S, dtype=torch.long)
    mask = torch.zeros(len(seqs), S)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, len(PROMPTS[i]) - 1 : len(s)] = 1  # the anchor may be the last prompt token
    lengths = torch.tensor([len(s) for s in seqs])
    with torch.no_grad():
        feats = target_features(model, ids, (torch.arange(S) < lengths[:, None]).long(), LAYERS)
    batch = TrainBatch(ids, mask, feats, lengths)
    drafter = _drafter(model).train()
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        out = dflash_loss(drafter, head, batch, block_size=B, num_anchors=64, generator=gen)
        opt.zero_grad()
        (out.loss_sum / out.weight_sum).backward()
        opt.step()
    drafter.eval()
    ev = sd.measure_tau(model, drafter, head, PROMPTS, 40, LAYERS, B)
    assert ev.matches_greedy
    assert ev.tau > 2.5, ev


@pytest.mark.slow
def test_evaluate_cli_untrained_drafter_tau_near_one(capsys):
    """`python -m app.evaluate` on the tiny target (built once into .cache/tiny) with a fresh drafter."""
    from app.evaluate import main

    root = Path(__file__).resolve().parents[1]
    rc = main(["--config", str(root / "conf" / "tiny.yaml"), f"tiny.cache_dir={root / '.cache' / 'tiny'}",
               "eval.num_prompts=2", "eval.max_new_tokens=24"])
    out = capsys.readouterr().out
    assert rc == 0, out
    result = dict(kv.split("=") for kv in out.strip().splitlines()[-1].removeprefix("RESULT ").split())
    assert 1.0 <= float(result["tau"]) < 1.3
    assert float(result["tok_s"]) > 0 and result["matches_greedy"] == "1"
