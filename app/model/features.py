"""Target features for DFlash: the concatenated hidden states of the chosen target layers.

`target_features` is the full HF path: every layer, the LM head and all hidden states. It is the
reference the truncated path (`app/model/target_trunk.py`) is tested against, and its fallback for
models whose decoder layers are not where HF usually keeps them.
"""
from __future__ import annotations

import torch


def target_features(model, input_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor | None, layer_ids,
                    position_ids_BS: torch.Tensor | None = None, **attn_kwargs) -> torch.Tensor:
    """[B, S, k*H]: `hidden_states[l + 1]` (output of decoder layer l) for each l, concatenated.

    `hidden_states[0]` is the embedding output, hence the +1 (z-lab's `extract_context_feature`).
    """
    out = model(
        input_ids=input_ids_BS,
        attention_mask=attention_mask_BS,
        position_ids=position_ids_BS,
        output_hidden_states=True,
        use_cache=False,
        **attn_kwargs,
    )
    return features_from_hidden_states(out.hidden_states, layer_ids)


def features_from_hidden_states(hidden_states, layer_ids) -> torch.Tensor:
    """Concatenate `hidden_states[l + 1]` for l in layer_ids along the last dim."""
    n = len(hidden_states) - 1
    bad = [l for l in layer_ids if not 0 <= l < n]
    if bad:
        raise ValueError(f"target_layer_ids {bad} outside the target's layers 0..{n - 1}")
    home = hidden_states[0].device  # the embedding's: a target spread over GPUs has layers elsewhere
    return torch.cat([hidden_states[l + 1].to(home) for l in layer_ids], dim=-1)
