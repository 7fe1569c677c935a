"""The drafter's architecture: the Qwen3 fields it copies from the target plus DFlash's own."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from app.config.drafter_sections import DrafterConfig, resolve_layer_ids


@dataclass(frozen=True)
class DrafterArch:
    """Everything needed to build a `DFlashDrafter` (and to write its HF `config.json`).

    Hidden size, heads and MLP width are the target's, as in z-lab's DFlash: the drafter reads
    the target's embeddings and writes into the target's LM head, so its width must match.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    max_position_embeddings: int
    num_target_layers: int
    attention_bias: bool = False
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "GQA needs whole groups"
            )
        if self.block_size < 2:
            raise ValueError(f"drafter.block_size={self.block_size}: a block needs >= 2 positions")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty; resolve it with resolve_layer_ids(...)")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} are outside the target's layers 0..{self.num_target_layers - 1}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"drafter.mask_token_id={self.mask_token_id} is not a row of the target embedding "
                f"(vocab_size={self.vocab_size}); pick an unused real token id"
            )

    @property
    def feature_dim(self) -> int:
        """Width of the concatenated target features fed to `fc` (k * H)."""
        return len(self.target_layer_ids) * self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DrafterArch":
        d = dict(d)
        d["target_layer_ids"] = tuple(d["target_layer_ids"])
        return cls(**d)

    @classmethod
    def from_target(
        cls,
        target_hf_config: Any,
        drafter: DrafterConfig,
        target_layer_ids: list[int] | tuple[int, ...],
    ) -> "DrafterArch":
        """Copy the target's Qwen3 fields (the MLP width unless `drafter.intermediate_size` sets one); an empty
        `target_layer_ids` means the DFlash default.
        `drafter.mask_token_id` is the resolved row (`app.config.checks.resolved_mask_token_id`), not -1."""
        get = _getter(target_hf_config)
        n_target = int(get("num_hidden_layers"))
        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        head_dim = get("head_dim") or hidden // heads
        return cls(
            hidden_size=hidden,
            num_layers=drafter.num_layers,
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=drafter.intermediate_size or int(get("intermediate_size")),
            rms_norm_eps=float(get("rms_norm_eps") or 1e-6),
            rope_theta=_rope_theta(get),
            vocab_size=int(get("vocab_size")),
            block_size=drafter.block_size,
            target_layer_ids=tuple(resolve_layer_ids(target_layer_ids, n_target, drafter.num_layers)),
            mask_token_id=int(drafter.mask_token_id),
            max_position_embeddings=int(get("max_position_embeddings") or 32768),
            num_target_layers=n_target,
            attention_bias=bool(get("attention_bias") or False),
        )


def _getter(cfg: Any):
    if isinstance(cfg, dict):
        return cfg.get
    return lambda name: getattr(cfg, name, None)


def _rope_theta(get) -> float:
    # transformers 5 keeps it in rope_parameters; 4.x and many config.json files at top level.
    params = get("rope_parameters") or get("rope_scaling") or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or get("rope_theta") or 10000.0)
