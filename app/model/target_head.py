"""The target's frozen `embed_tokens` and `lm_head`, read alone from its safetensors files."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

_EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight")
_HEAD_NAMES = ("lm_head.weight",)


class TargetHead(nn.Module):
    """Frozen input embedding and output projection of the target (requires_grad False).

    The drafter is trained through these but never updates them; loading only these two tensors
    keeps a drafter process from holding the whole target.
    """

    def __init__(self, embed_VH: torch.Tensor, lm_head_VH: torch.Tensor) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(embed_VH, freeze=True)
        self.lm_head = nn.Linear(lm_head_VH.shape[1], lm_head_VH.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(lm_head_VH, requires_grad=False)

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> "TargetHead":
        """Read `embed_tokens` and `lm_head` (or the tied embedding) from an HF folder."""
        model_dir = Path(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        tied = bool(cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", False)))
        files = tensor_files(model_dir)
        embed = _read_first(files, _EMBED_NAMES, model_dir)
        head = embed if tied else _read_first(files, _HEAD_NAMES, model_dir, fallback=embed)
        embed = embed.to(device=device, dtype=dtype)
        # Tied: share one tensor, as the target does; a separate copy would double the vocab memory.
        head = embed if head is None or tied else head.to(device=device, dtype=dtype)
        return cls(embed, head)


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file, from the shard index, or the single model.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / f for name, f in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise ValueError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _read_first(files: dict[str, Path], names: tuple[str, ...], model_dir: Path, fallback=None):
    from safetensors import safe_open

    for name in names:
        if name in files:
            with safe_open(str(files[name]), framework="pt") as f:
                return f.get_tensor(name)
    if fallback is not None:
        return fallback  # some tied checkpoints omit lm_head without saying tie_word_embeddings
    raise ValueError(f"none of {names} found in the safetensors of {model_dir}")
