"""The drafter's attention semantics: what a block can and cannot see."""
from __future__ import annotations

import pytest
import torch

from app.model.drafter import DFlashDrafter
from tests.toy import tiny_arch, tiny_qwen3_config



def _drafter(seed=0, **kw):
    torch.manual_seed(seed)
    arch = tiny_arch(tiny_qwen3_config(), num_layers=2, block_size=4, target_layer_ids=(0, 2), **kw)
    d = DFlashDrafter(arch).eval()
    for p in d.parameters():  # larger weights than the 0.02 init, so every path is visible
        p.data.normal_(0, 0.3)
    return d, arch


def _inputs(arch, S=16, anchors=((3, 9),), seed=1):
    g = torch.Generator().manual_seed(seed)
    A = len(anchors[0])
    emb = torch.randn(len(anchors), A * arch.block_size, arch.hidden_size, generator=g)
    feats = torch.randn(len(anchors), S, arch.feature_dim, generator=g)
    return emb, feats, torch.tensor(anchors)


@torch.no_grad()
def test_block_cannot_see_its_anchor_context_position():
    d, arch = _drafter()
    emb, feats, anchors = _inputs(arch)
    B, p = arch.block_size, 9
    base = d(emb, feats, anchors)
    at_anchor = feats.clone()
    at_anchor[0, p] += 5.0
    out = d(emb, at_anchor, anchors)
    assert torch.equal(out[0, B:], base[0, B:])  # block at p=9 unchanged
    before = feats.clone()
    before[0, p - 1] += 5.0
    out = d(emb, before, anchors)
    assert (out[0, B:] - base[0, B:]).abs().max() > 1e-3  # p-1 is visible
    assert torch.equal(out[0, :B], base[0, :B])  # block at p=3 sees neither


@torch.no_grad()
def test_blocks_are_isolated_and_match_single_anchor_runs():
    d, arch = _drafter()
    emb, feats, anchors = _inputs(arch)
    B = arch.block_size
    both = d(emb, feats, anchors)
    first = d(emb[:, :B], feats, anchors[:, :1])
    second = d(emb[:, B:], feats, anchors[:, 1:])
    torch.testing.assert_close(both, torch.cat([first, second], dim=1), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_block_attention_is_bidirectional():
    d, arch = _drafter()
    emb, feats, anchors = _inputs(arch, anchors=((5,),))
    base = d(emb, feats, anchors)
    emb2 = emb.clone()
    emb2[0, -1] += 3.0  # the last block position changes the first one: not causal
    assert (d(emb2, feats, anchors)[0, 0] - base[0, 0]).abs().max() > 1e-3


@torch.no_grad()
def test_padding_past_length_is_invisible():
    d, arch = _drafter()
    emb, feats, anchors = _inputs(arch, S=16, anchors=((14,),))
    base = d(emb, feats, anchors, torch.tensor([10]))
    feats2 = feats.clone()
    feats2[0, 10:] = 100.0
    torch.testing.assert_close(d(emb, feats2, anchors, torch.tensor([10])), base)


def test_parameter_names_are_zlabs():
    d, arch = _drafter()
    names = set(n for n, _ in d.named_parameters())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(arch.num_layers):
        pre = f"layers.{i}."
        expected |= {pre + "input_layernorm.weight", pre + "post_attention_layernorm.weight"}
        expected |= {f"{pre}self_attn.{x}_proj.weight" for x in "qkvo"}
        expected |= {f"{pre}self_attn.{x}_norm.weight" for x in "qk"}
        expected |= {f"{pre}mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
    assert names == expected
    assert d.fc.weight.shape == (arch.hidden_size, 2 * arch.hidden_size)  # [H, k*H]


def test_zero_features_makes_the_drafter_blind_to_the_target_and_leaves_fc_untrained():
    d, arch = _drafter()
    emb, feats, anchors = _inputs(arch)
    with torch.no_grad():
        seen = d(emb, feats, anchors)
        d.zero_features = True
        blind = d(emb, feats, anchors)
        assert torch.equal(blind, d(emb, torch.randn_like(feats), anchors))  # any features: the same output
        assert torch.equal(blind, d(emb, torch.zeros_like(feats), anchors))  # = zeroed features
        d.zero_features = False
        assert torch.equal(d(emb, torch.zeros_like(feats), anchors), blind)  # the switch is the zeroing, no more
        assert (seen - blind).abs().max() > 1e-3
    d.zero_features = True
    d(emb, feats, anchors).square().sum().backward()
    assert d.fc.weight.grad is None or torch.count_nonzero(d.fc.weight.grad) == 0  # nothing to learn from
    assert torch.count_nonzero(d.layers[0].mlp.down_proj.weight.grad) > 0  # the rest still trains
