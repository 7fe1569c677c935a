"""The drafter's sections: `drafter` (the DFlash architecture and its training sample) and `train`
(optimisation), with DFlash's defaults that depend on the target: the loss decay for a block size and
the target layers the drafter reads.
"""
from __future__ import annotations

from dataclasses import dataclass

from app.config.values import at_least, fail, finite, one_of, positive


@dataclass(frozen=True)
class DrafterConfig:
    """The DFlash drafter architecture and its training sample."""

    num_layers: int = 5
    intermediate_size: int = 0  # MLP width of each draft layer; 0 = the target's (z-lab's drafters)
    block_size: int = 16
    num_anchors: int = 512
    loss_gamma: float = 0.0  # 0 = DFlash default for the block size (7 for 16, 5 for 10, 4 for 8)
    mask_token_id: int = -1  # -1 = the tokenizer's mask token (the tiny target reserves one); else an id >= 0
    ce_chunk_rows: int = 1024  # rows of the LM head computed at once in the loss
    max_rows: int = 65536  # query rows (blocks x block_size) per drafter sub-batch; 0 = a whole job at once
    loss_negatives: int = 0  # 0 = the loss's softmax over the whole vocabulary; N = sampled softmax (labels + N ids)
    init: str = "random"  # a fresh drafter: random (z-lab's init) | target (its layers start as the target's last ones)

    def __post_init__(self) -> None:
        at_least("drafter.num_layers", self.num_layers, 1, "the drafter needs a layer")
        at_least("drafter.intermediate_size", self.intermediate_size, 0, "0 = the target's MLP width; else the width")
        at_least("drafter.block_size", self.block_size, 2, "a block is the anchor plus at least one predicted token")
        at_least("drafter.num_anchors", self.num_anchors, 1, "each sequence needs at least one anchor")
        at_least("drafter.loss_gamma", self.loss_gamma, 0, "0 = default for the block")
        if self.mask_token_id < -1:  # only -1 means auto; -2 is a typo, not a second auto
            fail("drafter.mask_token_id", self.mask_token_id, "must be -1 (the tokenizer's mask token) or an id >= 0")
        at_least("drafter.ce_chunk_rows", self.ce_chunk_rows, 1, "the loss computes at least one row at a time")
        at_least("drafter.max_rows", self.max_rows, 0, "0 = no bound; else rows per sub-batch")
        at_least("drafter.loss_negatives", self.loss_negatives, 0,
                 "0 = the full vocabulary; else uniform negatives per micro-batch (e.g. 4096)")
        one_of("drafter.init", self.init, ("random", "target"))
        if self.init == "target" and self.intermediate_size:
            fail("drafter.intermediate_size", self.intermediate_size, "must be 0 (the target's width) with "
                 "drafter.init=target, whose layers start as the target's; or set drafter.init=random")

    @property
    def gamma(self) -> float:
        """The loss decay the drafter trains with: `loss_gamma`, or for 0 DFlash's default for the block."""
        return self.loss_gamma or default_gamma(self.block_size)


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation."""

    epochs: int = 6
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    grad_accum: int = 4
    max_grad_norm: float = 1.0
    sample_every: int = 50
    seed: int = 0
    compile: str = "auto"  # torch.compile the drafter layers: auto (on for CUDA, off for CPU) | on | off
    activation_checkpointing: bool = False  # recompute each drafter layer in backward instead of saving it
    on_nonfinite: str = "stop"  # a step whose loss or grad norm is nan/inf: stop (no checkpoint of it) | skip

    def __post_init__(self) -> None:
        one_of("train.compile", self.compile, ("auto", "on", "off"))
        one_of("train.on_nonfinite", self.on_nonfinite, ("stop", "skip"))
        at_least("train.epochs", self.epochs, 1, "train at least one epoch")
        finite("train.lr", self.lr, "the DFlash default is 6e-4")
        if self.lr <= 0:
            fail("train.lr", self.lr, "must be > 0; the DFlash default is 6e-4")
        at_least("train.weight_decay", self.weight_decay, 0, "0 = none, the DFlash default")
        if not 0.0 <= self.warmup_ratio < 1.0:  # a range test: nan and inf fail it too
            fail("train.warmup_ratio", self.warmup_ratio, "must be in [0, 1); the default is 0.04")
        at_least("train.grad_accum", self.grad_accum, 1, "it counts micro-batches per optimizer step")
        positive("train.max_grad_norm", self.max_grad_norm)
        at_least("train.sample_every", self.sample_every, 0, "0 = never")


def default_gamma(block_size: int) -> float:
    """DFlash's loss decay for a block size: 7 for 16, 5 for 10, 4 for 8 (interpolated otherwise)."""
    table = {16: 7.0, 10: 5.0, 8: 4.0}
    if block_size in table:
        return table[block_size]
    return max(1.0, 7.0 * block_size / 16)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """k layers spread uniformly from layer 1 to layer n-3 (e.g. [1, 9, 17, 25, 33] for 36, k=5)."""
    lo, hi = 1, max(1, num_target_layers - 3)
    k = num_draft_layers
    if k == 1:
        return [num_target_layers // 2]
    return [round(lo + i * (hi - lo) / (k - 1)) for i in range(k)]


def resolve_layer_ids(layer_ids: list[int] | tuple[int, ...], n_target_layers: int, n_draft_layers: int) -> list[int]:
    """`layer_ids` as given, or DFlash's default spread when empty."""
    if layer_ids:
        return [int(i) for i in layer_ids]
    return default_target_layer_ids(n_target_layers, n_draft_layers)
