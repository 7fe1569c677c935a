"""Export the drafter as a Hugging Face folder that loaders of z-lab DFlash drafters accept.

`config.json`: a Qwen3 config (num_hidden_layers = drafter layers) with `architectures:
["DFlashDraftModel"]`, `block_size`, `num_target_layers` and `dflash_config: {target_layer_ids,
mask_token_id}`; `model.safetensors`: the drafter's state_dict, whose names are z-lab's
(`fc.weight`, `hidden_norm.weight`, `norm.weight`, `layers.{i}.self_attn.q_proj.weight`, ...).

`publish_export` puts a local export in place atomically: written into a unique temp sibling, made
readable by other users (an engine may run as another one), then exchanged in for the old folder in one
rename, so a reader sees the old complete folder or the new one, never a mix.
"""
from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch

from app.model.arch import DrafterArch
from app.model.drafter import DFlashDrafter

# Our own copy of the arch, so a reload is exact even for fields HF configs do not carry.
_ARCH_KEY = "dflash_ray_arch"


def hf_config_dict(arch: DrafterArch, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """The config.json content."""
    n = arch.num_layers
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": n,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,  # transformers 4.x and most engines
        "rope_parameters": {"rope_theta": arch.rope_theta, "rope_type": "default"},  # transformers 5
        "rope_scaling": None,
        "max_position_embeddings": arch.max_position_embeddings,
        "vocab_size": arch.vocab_size,
        "attention_bias": arch.attention_bias,
        "attention_dropout": 0.0,
        "initializer_range": arch.initializer_range,
        "tie_word_embeddings": False,
        # Not causal: the block attends to itself both ways (z-lab reads is_causal / layer_types).
        "is_causal": False,
        "layer_types": ["full_attention"] * n,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": n,
        "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": arch.block_size,
        "num_target_layers": arch.num_target_layers,
        "dflash_config": {
            "target_layer_ids": list(arch.target_layer_ids),
            "mask_token_id": arch.mask_token_id,
        },
        _ARCH_KEY: arch.to_dict(),
    }


def export_dtype(name: str) -> torch.dtype:
    """`checkpoint.export_dtype` as a torch dtype (bfloat16 by default: what the engines serve; an fp32
    export is twice the size and cast on load anyway)."""
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def export_drafter(drafter: DFlashDrafter, arch: DrafterArch, out_dir: str | Path,
                   dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors to `out_dir` (created); returns the folder."""
    from safetensors.torch import save_file

    drafter = getattr(drafter, "module", drafter)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    first = next(iter(state.values()))
    (out / "config.json").write_text(json.dumps(hf_config_dict(arch, first.dtype), indent=2) + "\n")
    return out


def make_readable(folder: str | Path) -> None:
    """Folders 0755, files 0644 (safetensors writes 0600, temp folders are 0700): another user's engine loads them."""
    root = Path(folder)
    root.chmod(0o755)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def publish_export(out_dir: str | Path, write: Callable[[Path], None],
                   keep_existing: Callable[[Path], bool] | None = None) -> Path | None:
    """`write(tmp)` fills a fresh temp sibling of `out_dir`, which then replaces `out_dir` atomically
    (app/storage/publish.py LocalStorage.publish). `keep_existing(out_dir)`, asked under a lock at swap time:
    True keeps the folder there and drops the new one (returns None), e.g. a better best drafter."""
    from app.storage.publish import LocalStorage

    out = Path(out_dir)
    store = LocalStorage(out.parent)
    tmp = store.stage(out.name)
    try:
        write(tmp)
        make_readable(tmp)
        with _lock(out.parent):
            if keep_existing is not None and out.exists() and keep_existing(out):
                shutil.rmtree(tmp, ignore_errors=True)
                return None
            return Path(store.publish(tmp, out.name))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def _lock(folder: Path):
    # Two targets finishing evaluations at once: the check of the folder there and the swap are one
    # step. The lock is on the parent folder itself, so it leaves no file behind.
    import fcntl

    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def arch_from_hf_config(cfg: dict[str, Any]) -> DrafterArch:
    """Our arch from a config.json (ours, or a z-lab drafter's)."""
    if _ARCH_KEY in cfg:
        return DrafterArch.from_dict(cfg[_ARCH_KEY])
    dflash = cfg.get("dflash_config", {})
    rope = cfg.get("rope_parameters") or {}
    return DrafterArch(
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta") or cfg.get("rope_theta", 10000.0)),
        vocab_size=cfg["vocab_size"],
        block_size=int(dflash.get("block_size", cfg.get("block_size", 16))),
        target_layer_ids=tuple(dflash.get("target_layer_ids", cfg.get("target_layer_ids", ()))),
        mask_token_id=int(dflash.get("mask_token_id", cfg.get("mask_token_id", 0))),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        num_target_layers=int(cfg.get("num_target_layers", max(dflash.get("target_layer_ids", [0])) + 1)),
        attention_bias=bool(cfg.get("attention_bias", False)),
    )


def load_drafter(path: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> tuple[DFlashDrafter, DrafterArch]:
    """Rebuild a drafter from an exported folder (strict: every tensor must match by name and shape).

    `path` may be a URI (`s3://...`, see app/storage/fetch.py): it is downloaded first."""
    from safetensors.torch import load_file

    from app.storage.fetch import fetch_dir

    path = fetch_dir(path, cache=False)  # rewritten in place: a cached copy only while the listing is unchanged
    if not (path / "config.json").exists():
        raise ValueError(f"{path} is not an exported drafter: no config.json (use export_drafter)")
    arch = arch_from_hf_config(json.loads((path / "config.json").read_text()))
    state = load_file(str(path / "model.safetensors"))
    drafter = DFlashDrafter(arch)
    drafter.load_state_dict(state, strict=True)
    first = next(iter(state.values()))
    return drafter.to(device=device, dtype=dtype or first.dtype).eval(), arch
