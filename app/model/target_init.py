"""`drafter.init: target`: a fresh drafter starts as the target's last layers instead of a random init.

Draft layer i of N takes the weights of target layer L - N + i (attention projections, their q/k norms when
the target has them, the MLP and both layer norms), the final norm is the target's, and `hidden_norm` (the
fused context's norm) is the first copied layer's input norm. `fc` stays random: nothing in the target maps
the concatenated features. The drafter then begins as a slice of the network whose next-token outputs it
learns to draft: on SmolLM2 (docs/drafter-quality.md) this fits the training answers' first positions
0.73 against 0.36 from a random init, at the same steps. The export is unchanged (same names, same shapes).
"""
from __future__ import annotations

from pathlib import Path

import torch

from app.model.target_head import tensor_files

_PREFIXES = ("model.", "model.language_model.", "")  # plain causal LMs, multimodal wrappers, bare trunks
_LAYER_PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")
_OPTIONAL = ("self_attn.q_norm", "self_attn.k_norm")  # Qwen3 has them, Llama does not (theirs then stay at 1)


def target_layer_names(drafter_layers: int, target_layers: int) -> dict[int, int]:
    """{draft layer i: the target layer it starts as}: the last `drafter_layers` of the target, in order."""
    first = target_layers - drafter_layers
    assert first >= 0, f"{drafter_layers} draft layers from a {target_layers}-layer target"
    return {i: first + i for i in range(drafter_layers)}


def init_from_target(drafter: torch.nn.Module, model_dir: str | Path, target_layers: int) -> list[str]:
    """Copy the target's last layers and final norm into `drafter` (in place); returns the names copied.

    Raises ValueError naming the tensor when a shape differs (e.g. `drafter.intermediate_size` set to
    another width than the target's): that drafter cannot start as the target's layers."""
    from safetensors import safe_open

    files = tensor_files(Path(model_dir))
    prefix = next((p for p in _PREFIXES if f"{p}norm.weight" in files), None)
    if prefix is None:
        raise ValueError(f"drafter.init=target: no final norm ('model.norm.weight') in {model_dir}; "
                         "use drafter.init=random for this target")
    plan = {"norm.weight": f"{prefix}norm.weight"}
    for mine, theirs in target_layer_names(len(drafter.layers), target_layers).items():
        for part in _LAYER_PARTS + _OPTIONAL:
            source = f"{prefix}layers.{theirs}.{part}.weight"
            if source in files:
                plan[f"layers.{mine}.{part}.weight"] = source
            elif part in _LAYER_PARTS:
                raise ValueError(f"drafter.init=target: {source} is not in {model_dir} (not a Llama/Qwen-style "
                                 "layer); use drafter.init=random for this target")
        if mine == 0:
            plan["hidden_norm.weight"] = f"{prefix}layers.{theirs}.input_layernorm.weight"
    by_file: dict[Path, list[tuple[str, str]]] = {}  # one handle per safetensors file, not one per tensor
    for name, source in plan.items():
        by_file.setdefault(files[source], []).append((name, source))
    state = drafter.state_dict()
    with torch.no_grad():
        for path, pairs in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for name, source in pairs:
                    _copy(state[name], f.get_tensor(source), name, source)
    return sorted(plan)


def _copy(mine: torch.Tensor, value: torch.Tensor, name: str, source: str) -> None:
    """`value` (the target's `source`) into the drafter's `name`, refused when the shapes differ."""
    if value.shape != mine.shape:
        raise ValueError(f"drafter.init=target: the drafter's {name} is {tuple(mine.shape)} but the "
                         f"target's {source} is {tuple(value.shape)}; leave drafter.intermediate_size at 0 "
                         "(the target's width) or set drafter.init=random")
    mine.copy_(value.to(mine.dtype))
