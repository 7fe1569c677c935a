"""Tiny Qwen3 targets and drafters built from configs (tests, benches; no downloads)."""
from __future__ import annotations

from pathlib import Path

import torch

from app.config.drafter_sections import DrafterConfig
from app.model.arch import DrafterArch

# The target layers and held-out prompts the tau tests share (spec decode, the race, the live and run-end paths):
# two layers of a 4-layer tiny target, three prompts of different lengths, one a repeated token.
LAYERS = [0, 2]
PROMPTS = [[5, 9, 17, 2], [100, 3], [7, 7, 7, 7, 7, 7, 40]]


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


TOY_BLOCK = 4  # block size of toy_drafter_parts


def toy_drafter_parts(seed: int = 0, V: int = 128, H: int = 32):
    """(drafter, head, batch, arch): a 2-layer drafter with weights large enough to matter, a random
    target head and a 3-sequence TrainBatch of uneven lengths (no saved target needed)."""
    from app.model.drafter import DFlashDrafter
    from app.model.loss import TrainBatch
    from app.model.target_head import TargetHead

    torch.manual_seed(seed)
    arch = tiny_arch(tiny_qwen3_config(hidden=H, vocab=V), num_layers=2, block_size=TOY_BLOCK, target_layer_ids=(0, 2))
    drafter = DFlashDrafter(arch)
    for p in drafter.parameters():
        p.data.normal_(0, 0.2)
    g = torch.Generator().manual_seed(seed + 1)
    head = TargetHead(torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.3)
    N, S = 3, 30
    lengths = torch.tensor([30, 17, 24])
    ids = torch.randint(0, V, (N, S), generator=g)
    mask = (torch.arange(S)[None] < lengths[:, None]).float()
    mask[:, :4] = 0
    batch = TrainBatch(ids, mask, torch.randn(N, S, arch.feature_dim, generator=g), lengths)
    return drafter, head, batch, arch
