"""Export to a Hugging Face folder that z-lab's DFlashDraftModel loads, and back."""
from __future__ import annotations

import json

import pytest
import torch

from app.model.export import export_drafter, load_drafter
from app.model.drafter import DFlashDrafter
from tests.toy import tiny_arch, tiny_qwen3_config

# z-lab's DFlashDraftModel parameter names (github z-lab/dflash, dflash/model.py), per layer i.
ZLAB_GLOBAL = {"fc.weight", "hidden_norm.weight", "norm.weight"}
ZLAB_LAYER = {
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
}


@pytest.fixture
def exported(tmp_path):
    torch.manual_seed(0)
    arch = tiny_arch(tiny_qwen3_config(), num_layers=2, block_size=4, target_layer_ids=(0, 2), mask_token_id=7)
    drafter = DFlashDrafter(arch).eval()
    for p in drafter.parameters():
        p.data.normal_(0, 0.3)
    export_drafter(drafter, arch, tmp_path / "out")
    return drafter, arch, tmp_path / "out"


def _inputs(arch, S=9):
    g = torch.Generator().manual_seed(3)
    return torch.randn(1, arch.block_size, arch.hidden_size, generator=g), torch.randn(1, S, arch.feature_dim, generator=g)


def test_config_json_fields(exported):
    _, arch, out = exported
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 4 and cfg["num_hidden_layers"] == 2 and cfg["num_target_layers"] == 4
    assert cfg["dflash_config"] == {"target_layer_ids": [0, 2], "mask_token_id": 7}
    assert cfg["hidden_size"] == 32 and cfg["num_key_value_heads"] == 2 and cfg["is_causal"] is False


def test_names_match_zlab_list(exported):
    from safetensors import safe_open

    _, arch, out = exported
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_slice("fc.weight").get_shape() == [arch.hidden_size, 2 * arch.hidden_size]
    expected = ZLAB_GLOBAL | {f"layers.{i}.{n}" for i in range(arch.num_layers) for n in ZLAB_LAYER}
    assert names == expected


def test_reload_gives_identical_outputs(exported):
    drafter, arch, out = exported
    again, arch2 = load_drafter(out)
    assert arch2 == arch
    emb, feats = _inputs(arch)
    anchors = torch.tensor([[9]])
    with torch.no_grad():
        assert torch.equal(again(emb, feats, anchors), drafter(emb, feats, anchors))


def test_zlab_dflash_draft_model_gives_the_same_hidden_states(exported):
    """Load our export with z-lab's own class (pip package `dflash`) and compare outputs."""
    zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash package is not installed")
    drafter, arch, out = exported
    model, info = zlab.DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.target_layer_ids == [0, 2] and model.block_size == 4 and model.mask_token_id == 7
    emb, feats = _inputs(arch)
    S = feats.shape[1]
    with torch.no_grad():
        theirs = model.eval()(position_ids=torch.arange(S + arch.block_size)[None], noise_embedding=emb,
                              target_hidden=feats)
        ours = drafter(emb, feats, torch.tensor([[S]]))  # anchor at S: the whole context visible
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_wider_draft_mlp_than_the_targets_is_exported_and_reloaded(tmp_path):
    """`drafter.intermediate_size` widens the draft layers' MLP only: the export says so in config.json (what
    an engine builds the drafter from) and reloads to the same outputs; 0 keeps the target's width."""
    from dataclasses import replace

    from app.config.drafter_sections import DrafterConfig
    from app.model.arch import DrafterArch

    target = tiny_qwen3_config()
    base = DrafterConfig(num_layers=2, block_size=4, mask_token_id=7)
    assert DrafterArch.from_target(target, base, [0, 2]).intermediate_size == target.intermediate_size
    arch = DrafterArch.from_target(target, replace(base, intermediate_size=3 * target.intermediate_size), [0, 2])
    assert arch.intermediate_size == 3 * target.intermediate_size and arch.hidden_size == target.hidden_size
    torch.manual_seed(0)
    drafter = DFlashDrafter(arch).eval()
    assert drafter.layers[0].mlp.up_proj.weight.shape == (arch.intermediate_size, arch.hidden_size)
    out = export_drafter(drafter, arch, tmp_path / "wide")
    assert json.loads((out / "config.json").read_text())["intermediate_size"] == arch.intermediate_size
    again, arch2 = load_drafter(out, dtype=torch.float32)
    emb, feats = _inputs(arch)
    with torch.no_grad():
        assert arch2 == arch and torch.equal(again(emb, feats, torch.tensor([[9]])), drafter(emb, feats, torch.tensor([[9]])))
    with pytest.raises(ValueError, match="drafter.intermediate_size"):
        DrafterConfig(intermediate_size=-1)
