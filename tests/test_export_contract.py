"""The export against the engines' reading rules (issue 25, item 4), written from the rules, not from our code.

What vLLM (qwen3_dflash, its speculators reader), SGLang (DFLASH worker) and z-lab's DFlashDraftModel read:
- `dflash_config.target_layer_ids`: 0-based decoder-layer ids (SGLang and z-lab index them as given);
  vLLM numbers hidden states from the embeddings and reads layer l's output as l + 1, which the
  speculators folder writes as `aux_hidden_state_layer_ids` (its readers: tests/test_speculators_layers.py).
  Ascending, distinct, below the target's last layer (its hidden state is taken after the final norm only in HF).
- `fc.weight` is [hidden, len(target_layer_ids) x target hidden]; every decoder tensor has z-lab's
  name and its Qwen3 shape; no `embed_tokens` / `lm_head` (the engines share the target's). SGLang
  skips unknown names and never checks for missing ones, so a renamed tensor would load as random
  weights there: the names are checked both ways.
- `is_causal` false (the block attends both ways), `block_size` present (SGLang infers the block from
  it), `dflash_config.mask_token_id` a row of the vocabulary that is neither pad nor eos.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from app.model.drafter import DFlashDrafter
from app.model.export import export_drafter, export_dtype
from app.model.engines import write_speculators
from tests.toy import save_tiny_target, tiny_arch, tiny_qwen3_config

LAYER_IDS = (0, 2)  # of a 4-layer target
PER_LAYER = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
             "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def expected_shapes(cfg: dict, target_hidden: int) -> dict[str, list[int]]:
    """Tensor name -> shape, from the config the engines read (z-lab's DFlashDraftModel layout)."""
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    layer = {"input_layernorm": [h], "post_attention_layernorm": [h], "self_attn.q_proj": [q, h],
             "self_attn.k_proj": [kv, h], "self_attn.v_proj": [kv, h], "self_attn.o_proj": [h, q],
             "self_attn.q_norm": [hd], "self_attn.k_norm": [hd], "mlp.gate_proj": [inter, h],
             "mlp.up_proj": [inter, h], "mlp.down_proj": [h, inter]}
    assert set(layer) == set(PER_LAYER)
    shapes = {"fc.weight": [h, len(cfg["dflash_config"]["target_layer_ids"]) * target_hidden],
              "hidden_norm.weight": [h], "norm.weight": [h]}
    for i in range(cfg["num_hidden_layers"]):
        shapes.update({f"layers.{i}.{n}.weight": s for n, s in layer.items()})
    return shapes


def contract_violations(folder: str | Path, target_dir: str | Path) -> list[str]:
    """Every rule an engine relies on that the export at `folder` breaks, for the target at `target_dir`."""
    from safetensors import safe_open

    folder, bad = Path(folder), []
    cfg = json.loads((folder / "config.json").read_text())
    target = json.loads((Path(target_dir) / "config.json").read_text())
    dflash = cfg.get("dflash_config") or {}
    ids = dflash.get("target_layer_ids")
    n_target = target["num_hidden_layers"]
    if cfg.get("architectures") != ["DFlashDraftModel"]:
        bad.append(f"architectures {cfg.get('architectures')} (engines pick the loader by DFlashDraftModel)")
    if not isinstance(cfg.get("block_size"), int) or cfg["block_size"] < 2:
        bad.append(f"block_size {cfg.get('block_size')!r} missing or < 2 (SGLang infers the block from it)")
    if cfg.get("is_causal") is not False:
        bad.append(f"is_causal {cfg.get('is_causal')!r}: the block attends both ways, engines read it as false")
    if not ids or ids != sorted(set(ids)) or not all(0 <= i < n_target - 1 for i in ids):
        bad.append(f"target_layer_ids {ids}: 0-based, ascending, distinct, below the last layer {n_target - 1}")
    if cfg.get("num_target_layers") != n_target:
        bad.append(f"num_target_layers {cfg.get('num_target_layers')} != the target's {n_target}")
    mask = dflash.get("mask_token_id")
    eos = target.get("eos_token_id")
    specials = {target.get("pad_token_id")} | set(eos if isinstance(eos, list) else [eos])
    if not isinstance(mask, int) or not 0 <= mask < target["vocab_size"] or mask in specials:
        bad.append(f"mask_token_id {mask!r}: must be a vocabulary row (< {target['vocab_size']}), not pad/eos {specials}")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        have = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    if ids:
        want = expected_shapes(cfg, target["hidden_size"])
        bad += [f"missing tensor {k} (SGLang would leave it random)" for k in sorted(set(want) - set(have))]
        bad += [f"unexpected tensor {k}" for k in sorted(set(have) - set(want))]
        bad += [f"{k} has shape {have[k]}, engines expect {s}" for k, s in want.items() if k in have and have[k] != s]
    bad += [f"{k}: engines share the target's, the drafter must not carry one" for k in have
            if "embed_tokens" in k or "lm_head" in k]
    return bad


def speculators_violations(folder: str | Path, zlab: str | Path) -> list[str]:
    """vLLM's speculators reader: method and token count from the checkpoint, layer ids in both numberings."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    src = json.loads((Path(zlab) / "config.json").read_text())
    ids, bad = src["dflash_config"]["target_layer_ids"], []
    if cfg.get("speculators_model_type") != "dflash":
        bad.append("speculators_model_type is not dflash")
    # The readers' numbering (tests/test_speculators_layers.py: vLLM taps aux - 1, the converter writes + 1).
    if cfg.get("aux_hidden_state_layer_ids") != [i + 1 for i in ids]:
        bad.append(f"aux_hidden_state_layer_ids {cfg.get('aux_hidden_state_layer_ids')} is not target_layer_ids "
                   f"{ids} + 1 (the readers tap aux - 1)")
    if cfg.get("eagle_aux_hidden_state_layer_ids") != [i + 1 for i in ids]:
        bad.append("eagle_aux_hidden_state_layer_ids is not target_layer_ids + 1 (vLLM's numbering)")
    methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
    if methods[0].get("speculative_tokens") != src["block_size"] - 1:
        bad.append(f"speculative_tokens {methods[0].get('speculative_tokens')} != block_size - 1")
    if cfg.get("mask_token_id") != src["dflash_config"]["mask_token_id"]:
        bad.append("mask_token_id differs from the export's")
    if (Path(folder) / "model.safetensors").read_bytes() != (Path(zlab) / "model.safetensors").read_bytes():
        bad.append("weights differ from drafter/")
    return bad


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    save_tiny_target(root / "target", pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    arch = tiny_arch(tiny_qwen3_config(), num_layers=2, block_size=4, target_layer_ids=LAYER_IDS, mask_token_id=7)
    return DFlashDrafter(arch).eval(), arch, root / "target"


def _export(parts, out: Path) -> Path:
    drafter, arch, _ = parts
    return export_drafter(drafter, arch, out, dtype=export_dtype("bfloat16"))


def test_the_export_keeps_every_engine_rule(parts, tmp_path):
    out = _export(parts, tmp_path / "drafter")
    assert contract_violations(out, parts[2]) == []
    spec = write_speculators(out, tmp_path / "drafter-speculators", parts[2])
    assert speculators_violations(spec, out) == []


def test_one_renamed_tensor_breaks_the_contract(parts, tmp_path, monkeypatch):
    """A rename in the drafter's state dict (what a refactor of the module names would do) fails here."""
    original = DFlashDrafter.state_dict

    def renamed(self, *a, **kw):
        state = original(self, *a, **kw)
        state["layers.1.self_attn.o.weight"] = state.pop("layers.1.self_attn.o_proj.weight")
        return state

    monkeypatch.setattr(DFlashDrafter, "state_dict", renamed)
    out = _export(parts, tmp_path / "drafter")
    assert contract_violations(out, parts[2]) == [
        "missing tensor layers.1.self_attn.o_proj.weight (SGLang would leave it random)",
        "unexpected tensor layers.1.self_attn.o.weight",
    ]


def test_a_dropped_block_size_breaks_the_contract(parts, tmp_path, monkeypatch):
    import app.model.export as export

    original = export.hf_config_dict

    def without_block(*a, **kw):
        cfg = original(*a, **kw)
        del cfg["block_size"]
        return cfg

    monkeypatch.setattr(export, "hf_config_dict", without_block)
    out = _export(parts, tmp_path / "drafter")
    assert contract_violations(out, parts[2]) == ["block_size None missing or < 2 (SGLang infers the block from it)"]


def test_other_rule_breaks_are_named(parts, tmp_path):
    out = _export(parts, tmp_path / "drafter")
    cfg = json.loads((out / "config.json").read_text())
    for key, value, needle in [("is_causal", True, "is_causal True"),
                               ("dflash_config", {**cfg["dflash_config"], "mask_token_id": 2}, "mask_token_id 2"),
                               ("dflash_config", {**cfg["dflash_config"], "target_layer_ids": [2, 0]},
                                "target_layer_ids [2, 0]"),
                               ("dflash_config", {**cfg["dflash_config"], "target_layer_ids": [0, 3]},
                                "target_layer_ids [0, 3]")]:
        (out / "config.json").write_text(json.dumps({**cfg, key: value}))
        assert any(needle in v for v in contract_violations(out, parts[2])), (key, value)
    (out / "config.json").write_text(json.dumps(cfg))
    spec = write_speculators(out, tmp_path / "spec", parts[2])
    spec_cfg = json.loads((spec / "config.json").read_text())
    (spec / "config.json").write_text(json.dumps({**spec_cfg, "eagle_aux_hidden_state_layer_ids": LAYER_IDS}))
    assert speculators_violations(spec, out) == ["eagle_aux_hidden_state_layer_ids is not target_layer_ids + 1 "
                                                 "(vLLM's numbering)"]
