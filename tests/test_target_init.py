"""drafter.init=target: a fresh drafter starts as the target's last layers (app/model/target_init.py)."""
from __future__ import annotations

import pytest
import torch

from app.config.drafter_sections import DrafterConfig
from app.model.build import build_or_load_drafter

CPU = torch.device("cpu")


def _build(path, **kw):
    cfg = DrafterConfig(num_layers=2, block_size=4, **kw)
    return build_or_load_drafter(str(path), None, cfg, [0, 2], 3, CPU, torch.float32, seed=0)


def test_target_init_copies_the_last_layers_and_the_final_norm(tiny_target, tmp_path):
    """Draft layer i = target layer L-2+i, tensor for tensor; the final norm and hidden_norm come from the
    target; fc (nothing in the target maps the features) is the random init's, as with init=random. A sharded
    target (12 files, each read through one handle) gives the same drafter."""
    model, path = tiny_target
    target = model.model
    L = len(target.layers)
    mine, _, _ = _build(path, init="target")
    fresh, _, _ = _build(path)
    for i, theirs in enumerate((L - 2, L - 1)):
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "input_layernorm", "post_attention_layernorm"):
            got = mine.get_parameter(f"layers.{i}.{part}.weight")
            assert torch.equal(got, target.get_parameter(f"layers.{theirs}.{part}.weight")), (i, part)
    assert torch.equal(mine.norm.weight, target.norm.weight)
    assert torch.equal(mine.hidden_norm.weight, target.layers[L - 2].input_layernorm.weight)
    assert torch.equal(mine.fc.weight, fresh.fc.weight)
    assert not torch.equal(fresh.layers[0].self_attn.q_proj.weight, mine.layers[0].self_attn.q_proj.weight)
    model.save_pretrained(str(tmp_path), max_shard_size="20KB")
    sharded = _build(tmp_path, init="target")[0].state_dict()
    assert all(torch.equal(v, sharded[k]) for k, v in mine.state_dict().items())


def test_target_init_changes_what_the_drafter_predicts(tiny_target):
    """Started as the target's last layers, the drafter's block outputs differ from the random init's (the
    copy reaches the forward, not only the state dict)."""
    model, path = tiny_target
    mine, head, arch = _build(path, init="target")
    fresh, _, _ = _build(path)
    ids = torch.tensor([[5, 3, 3, 3]])
    feats = torch.randn(1, 6, arch.feature_dim, generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[6]])
    with torch.no_grad():
        a = mine(head.embed(ids), feats, anchors)
        b = fresh(head.embed(ids), feats, anchors)
    assert (a - b).abs().max() > 1e-2


def test_target_init_refuses_another_mlp_width_before_any_actor():
    with pytest.raises(ValueError, match=r"drafter.intermediate_size=64 .*drafter.init=random"):
        DrafterConfig(init="target", intermediate_size=64)
    with pytest.raises(ValueError, match="drafter.init"):
        DrafterConfig(init="targets")
