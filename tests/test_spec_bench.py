"""The bench's speculative decoding: the drafter replayed on greedy output, and the greedy-vs-spec race."""
from __future__ import annotations

import pytest
import torch

import app.model.spec_bench as sb
import app.model.spec_decode as sd
from app.model.drafter import DFlashDrafter
from app.model.features import target_features
from app.model.references import tau_on_greedy
from app.model.target_head import TargetHead
from tests.toy import LAYERS, PROMPTS, tiny_arch

B = 4


@pytest.fixture(scope="module")
def target(tiny_target):
    model, path = tiny_target
    return model, TargetHead.load(path)


def _drafter(model, seed=0):
    torch.manual_seed(seed)
    drafter = DFlashDrafter(tiny_arch(model.config, block_size=B, target_layer_ids=LAYERS)).eval()
    for p in drafter.parameters():  # larger than the 0.02 init, so the drafts depend on the features
        p.data.normal_(0, 0.3)
    return drafter


def _oracle_drafter(model, prompts, n_new):
    """A draft_block stand-in that knows greedy continuations: it drafts 2 right tokens, then wrong ones."""
    seqs = [p + sd.greedy_reference(model, p, n_new) for p in prompts]

    def draft(drafter, head, context, anchor_token, block_size):
        n = context.shape[0]
        seq = next(s for s in seqs if len(s) > n and s[n] == anchor_token)
        cont = seq[n + 1:n + block_size]
        return (cont[:2] + [(t + 1) % 128 for t in cont[2:]] + [0] * block_size)[:block_size - 1]

    return draft


def test_replayed_drafter_drafts_what_spec_decoding_drafts(target):
    model, head = target
    torch.manual_seed(0)
    drafter = DFlashDrafter(tiny_arch(model.config, block_size=B, target_layer_ids=LAYERS)).eval()
    for p in drafter.parameters():  # larger than the 0.02 init, so the drafts depend on the features
        p.data.normal_(0, 0.3)
    for prompt in PROMPTS:
        spec = sd.spec_generate(model, drafter, head, prompt, 24, LAYERS, B)
        seq = torch.tensor([prompt + spec.tokens])
        with torch.no_grad():
            feats = target_features(model, seq, torch.ones_like(seq), LAYERS)[0]
        per = tau_on_greedy(sb.drafter_proposer(drafter, head, feats, B), prompt, spec.tokens, B, 24)
        assert per == spec.accepted_per_forward


def test_race_checks_identical_outputs_alternates_order_and_times_both(target, monkeypatch):
    model, head = target
    now, calls = [0.0], []
    real_greedy, real_spec = sb.greedy_reference, sb.spec_generate

    def greedy(*a, **k):
        calls.append("greedy")
        now[0] += 0.3  # plain greedy takes 0.3 s a prompt here, speculative 0.1 s
        return real_greedy(*a, **k)

    def spec(*a, **k):
        calls.append("spec")
        now[0] += 0.1
        return real_spec(*a, **k)

    monkeypatch.setattr(sb, "greedy_reference", greedy)
    monkeypatch.setattr(sb, "spec_generate", spec)
    monkeypatch.setattr(sd, "draft_block", _oracle_drafter(model, PROMPTS, 16))
    outputs: list = []
    res = sb.race(model, _drafter(model), head, PROMPTS, 16, LAYERS, B, warmup=1, clock=lambda: now[0], outputs=outputs)
    assert calls == ["greedy", "spec"] + ["greedy", "spec", "spec", "greedy", "greedy", "spec"]  # warm-up, then alternating
    assert res.identical and res.differing_prompts == [] and outputs == [real_greedy(model, p, 16) for p in PROMPTS]
    assert res.greedy_tokens == res.spec_tokens == 48
    assert res.greedy_s == pytest.approx(0.9) and res.spec_s == pytest.approx(0.3)
    assert res.speedup == pytest.approx(3.0)
    assert res.accepted_per_forward == [3] * 15 and res.tau == 3.0  # 2 right drafts + the target's token; 5 x 3 = 15 after the prefill


def test_race_reports_a_prompt_whose_outputs_differ(target, monkeypatch):
    model, head = target
    real_spec = sb.spec_generate

    def off_by_one(*a, **k):
        out = real_spec(*a, **k)
        if a[3] == PROMPTS[1]:
            out.tokens[-1] += 1
        return out

    monkeypatch.setattr(sb, "spec_generate", off_by_one)
    monkeypatch.setattr(sd, "draft_block", _oracle_drafter(model, PROMPTS, 12))
    res = sb.race(model, _drafter(model), head, PROMPTS, 12, LAYERS, B, warmup=0)
    assert not res.identical and res.differing_prompts == [1]


def test_replay_drafts_equal_draft_block_and_are_computed_only_when_read(target):
    model, head = target
    torch.manual_seed(1)
    drafter = DFlashDrafter(tiny_arch(model.config, block_size=B, target_layer_ids=LAYERS)).eval()
    for p in drafter.parameters():
        p.data.normal_(0, 0.3)
    seq = PROMPTS[2] + sd.greedy_reference(model, PROMPTS[2], 8)
    with torch.no_grad():
        feats = target_features(model, torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long), LAYERS)[0]
    propose = sb.drafter_proposer(drafter, head, feats, B)
    for n in (3, 7, len(seq) - 1):
        lazy = propose(seq[:n + 1], B - 1)
        assert lazy.done == {} and len(lazy) == B - 1
        assert list(lazy) == sd.draft_block(drafter, head, feats[:n], seq[n], B)
    lazy = propose(seq[:4], B - 1)[:2]
    assert len(lazy) == 2 and lazy[1] == sd.draft_block(drafter, head, feats[:3], seq[3], B)[1] and set(lazy.done) == {1}
    assert "fuse_context" not in vars(drafter)  # the identity stand-in is gone after the block


def test_spec_decoding_fuses_each_context_position_once(target):
    """The drafter's fc + norm runs once per accepted position, not over the whole context every block."""
    model, head = target
    drafter = _drafter(model)
    rows = []
    hook = drafter.fc.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    try:
        res = sd.spec_generate(model, drafter, head, PROMPTS[2], 20, LAYERS, B)
    finally:
        hook.remove()
    assert len(res.accepted_per_forward) > 3  # several blocks drafted
    assert sum(rows) == len(PROMPTS[2]) + len(res.tokens) - 1  # every position before the last token, once
    assert "fuse_context" not in vars(drafter)


def test_bench_replay_drafts_every_block_in_one_forward_as_the_proposer_does(target):
    """quality_fit's drafter replay (every anchor of a prompt in one batched forward) gives the same tau per
    forward as `drafter_proposer` (one forward per block), on prompts the toy drafter gets some right."""
    from app.bench.runs.quality_fit import drafter_on, replay

    model, head = target
    drafter = _drafter(model)
    refs = [sd.greedy_reference(model, p, 12) for p in PROMPTS]
    feats = [target_features(model, torch.tensor([p + r]), None, LAYERS)[0] for p, r in zip(PROMPTS, refs)]
    one = replay(lambda i: sb.drafter_proposer(drafter, head, feats[i], B), PROMPTS, refs, B, 12)
    batched = replay(drafter_on(drafter, head)({"prompts": PROMPTS, "refs": refs, "feats": feats}),
                     PROMPTS, refs, B, 12)
    assert batched == one and one["pos1"] > 0  # drafts the replay accepted, read from the batched forward too


def test_step_costs_time_each_block_and_the_one_token_forward(target):
    from app.bench.runs.quality_speed import block_choice, step_costs

    model, head = target
    costs = step_costs(model, _drafter(model), head, PROMPTS[0], LAYERS, [2, 4], context_tokens=8, repeats=2)
    assert costs["verify_1_ms"] > 0 and set(costs["verify_ms"]) == set(costs["draft_ms"]) == {2, 4}
    assert all(v > 0 for v in [*costs["verify_ms"].values(), *costs["draft_ms"].values()])
    assert set(block_choice(costs, [0.5, 0.2, 0.1])) == {2, 4}
