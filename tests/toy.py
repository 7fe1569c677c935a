"""Tiny Qwen3 targets and drafters built from configs (tests, benches; no downloads)."""
from __future__ import annotations

from pathlib import Path

import torch

from app.config.schema import DrafterConfig
from app.model.arch import DrafterArch


def tiny_qwen3_config(hidden: int = 32, layers: int = 4, heads: int = 4, kv_heads: int = 2, vocab: int = 128,
                      tie: bool = False, **kw):
    """A transformers Qwen3Config small enough for CPU tests."""
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, intermediate_size=2 * hidden, vocab_size=vocab, max_position_embeddings=512,
        tie_word_embeddings=tie, **kw,
    )


def save_tiny_target(out_dir: str | Path, seed: int = 0, **cfg_kw):
    """Build a random tiny Qwen3ForCausalLM, save_pretrained to `out_dir`; returns the (eval) model."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_qwen3_config(**cfg_kw)).eval()
    model.save_pretrained(str(out_dir))
    return model


def tiny_arch(target_cfg, num_layers: int = 2, block_size: int = 4, mask_token_id: int = 3,
              target_layer_ids: tuple[int, ...] = ()) -> DrafterArch:
    """A DrafterArch over `target_cfg` with DFlash's default layer spread unless given."""
    d = DrafterConfig(num_layers=num_layers, block_size=block_size, mask_token_id=mask_token_id)
    return DrafterArch.from_target(target_cfg, d, list(target_layer_ids))
