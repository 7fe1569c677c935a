"""Building the drafter and the frozen target head for a run (shared by drafters and evaluation)."""
from __future__ import annotations

from dataclasses import replace

import torch

from app.config.drafter_sections import DrafterConfig


def build_or_load_drafter(model_dir: str, drafter_dir: str | None, drafter_cfg: DrafterConfig, layer_ids: list[int],
                          mask_token_id: int, device: torch.device, dtype: torch.dtype, seed: int,
                          param_dtype: torch.dtype | None = None):
    """(drafter, target head, arch): a fresh drafter seeded by `seed`, or one exported to `drafter_dir`.

    The frozen head is in `dtype`; the drafter's parameters in `param_dtype` (default `dtype`).
    Training passes float32: AdamW updates of ~lr vanish against bf16 weights near 1 (norms)."""
    from transformers import AutoConfig

    from app.model.export import load_drafter
    from app.model.arch import DrafterArch
    from app.model.drafter import DFlashDrafter
    from app.model.target_head import TargetHead

    head = TargetHead.load(model_dir, dtype=dtype, device=device)
    if drafter_dir:
        drafter, arch = load_drafter(drafter_dir, device=device)
    else:
        arch = DrafterArch.from_target(
            AutoConfig.from_pretrained(model_dir), replace(drafter_cfg, mask_token_id=mask_token_id), list(layer_ids)
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # every replica builds the same initial weights
            drafter = DFlashDrafter(arch)
        if drafter_cfg.init == "target":
            from app.model.target_init import init_from_target

            init_from_target(drafter, model_dir, arch.num_target_layers)
    return drafter.to(device=device, dtype=param_dtype or dtype), head, arch


def drafter_state_bytes(model_dir: str, drafter_cfg: DrafterConfig, layer_ids: list[int], mask_token_id: int) -> int:
    """Bytes of the drafter's float32 state dict (what rank 0 puts in the object store for each live
    evaluation, app/model/drafter_tau.py `weights_to_numpy`), counted on the meta device: no memory used."""
    from transformers import AutoConfig

    from app.model.arch import DrafterArch
    from app.model.drafter import DFlashDrafter

    arch = DrafterArch.from_target(
        AutoConfig.from_pretrained(model_dir), replace(drafter_cfg, mask_token_id=mask_token_id), list(layer_ids))
    with torch.device("meta"):
        drafter = DFlashDrafter(arch)
    return 4 * sum(t.numel() for t in drafter.state_dict().values())
