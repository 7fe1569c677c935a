"""The DFlash training sample and loss: anchors, same-position labels, decay-weighted chunked CE.

Returns SUMS (loss, weights, correct counts), not means: the trainer all-reduces the weight sum
across ranks and micro-batches and divides the gradients by it, so every token weighs the same.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from app.config.schema import default_gamma
from app.model.chunked_ce import chunked_cross_entropy


@dataclass
class TrainBatch:
    """One micro-batch on the drafter's device: token ids, loss mask, target features, lengths."""

    input_ids_BS: torch.Tensor  # long
    loss_mask_BS: torch.Tensor  # float, 0 on padding
    hidden_BSD: torch.Tensor  # target features, k*H wide
    lengths_B: torch.Tensor  # long

    @classmethod
    def from_hidden_batch(cls, hb, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "TrainBatch":
        """From an `app.messages.HiddenBatch` (read-only numpy, bf16 as a uint16 view)."""
        return cls(
            input_ids_BS=_to_torch(hb.input_ids_BS, device, torch.long),
            loss_mask_BS=_to_torch(hb.loss_mask_BS, device, torch.float32),
            hidden_BSD=_hidden_to_torch(hb.hidden_BSD, hb.hidden_dtype, device, dtype),
            lengths_B=_to_torch(hb.lengths_B, device, torch.long),
        )


def _readonly_view(a: np.ndarray) -> torch.Tensor:
    # The object store hands out read-only buffers; torch warns on them. The caller copies (or
    # clones) before anything could write, so the view itself is safe.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _copy_to(t: torch.Tensor, device, dtype) -> torch.Tensor:
    out = t.to(device=device, dtype=dtype)
    return out.clone() if out.data_ptr() == t.data_ptr() else out


def _to_torch(a: np.ndarray, device, dtype) -> torch.Tensor:
    return _copy_to(_readonly_view(np.asarray(a)), device, dtype)


def _hidden_to_torch(a: np.ndarray, hidden_dtype: str, device, dtype) -> torch.Tensor:
    if hidden_dtype == "bfloat16":
        t = _readonly_view(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = _readonly_view(a)
    return _copy_to(t, device, dtype)


def sample_anchors(
    loss_mask_S: torch.Tensor, length: int, block_size: int, num_anchors: int, generator: torch.Generator | None
) -> torch.Tensor:
    """Up to `num_anchors` sorted positions p with loss_mask[p] == 1 and p <= length - B, no repeats."""
    last = int(length) - block_size
    if last < 0:
        return torch.zeros(0, dtype=torch.long)
    ok = loss_mask_S[: last + 1].detach().cpu() > 0
    cand = torch.nonzero(ok, as_tuple=False)[:, 0]
    if cand.numel() > num_anchors:
        cand = cand[torch.randperm(cand.numel(), generator=generator)[:num_anchors]]
    return cand.sort().values


@dataclass
class LossOutput:
    """Sums over one micro-batch. `correct_sum`/`topk_correct_sum` are loss-weighted;
    `per_pos_*` are unweighted counts over positions with loss_mask 1."""

    loss_sum: torch.Tensor  # differentiable: sum of weight x CE
    weight_sum: float
    correct_sum: float
    per_pos_correct: torch.Tensor  # [B-1], block positions 1..B-1
    per_pos_count: torch.Tensor  # [B-1]
    accept_len_sum: float  # sum over blocks of (correct prefix + 1)
    num_blocks: int
    tokens: int  # real tokens in the batch
    topk_correct_sum: float = 0.0


def _anchor_table(batch: TrainBatch, block_size: int, num_anchors: int, generator):
    """Anchors per sequence padded to the longest list: (anchors [N, A], valid [N, A])."""
    per_seq = [
        sample_anchors(batch.loss_mask_BS[i], int(batch.lengths_B[i]), block_size, num_anchors, generator)
        for i in range(batch.input_ids_BS.shape[0])
    ]
    A = max((a.numel() for a in per_seq), default=0)
    N = len(per_seq)
    anchors = torch.zeros(N, A, dtype=torch.long)
    valid = torch.zeros(N, A, dtype=torch.bool)
    for i, a in enumerate(per_seq):
        anchors[i, : a.numel()] = a
        valid[i, : a.numel()] = True
    dev = batch.input_ids_BS.device
    return anchors.to(dev), valid.to(dev)


def block_input_ids(input_ids_BS: torch.Tensor, anchors_NA: torch.Tensor, block_size: int, mask_token_id: int):
    """[N, A, B]: the anchor's own token, then MASK x (B-1)."""
    N, A = anchors_NA.shape
    ids = torch.full((N, A, block_size), mask_token_id, dtype=torch.long, device=input_ids_BS.device)
    ids[:, :, 0] = input_ids_BS.gather(1, anchors_NA)
    return ids


def block_labels(batch: TrainBatch, anchors_NA: torch.Tensor, block_size: int):
    """Labels and label mask [N, A, B-1]: output k of block j predicts input_ids[p_j + k]
    (the same position, no shift), k = 1..B-1; the mask is loss_mask there and 0 past the length."""
    N, A = anchors_NA.shape
    k = torch.arange(1, block_size, device=anchors_NA.device)
    pos = anchors_NA[:, :, None] + k
    in_seq = pos < batch.lengths_B[:, None, None]
    pos_c = pos.clamp(max=batch.input_ids_BS.shape[1] - 1).flatten(1)
    labels = batch.input_ids_BS.gather(1, pos_c).view(N, A, block_size - 1)
    lmask = batch.loss_mask_BS.gather(1, pos_c).view(N, A, block_size - 1) * in_seq
    return labels, lmask


def _zero_output(drafter, batch: TrainBatch, block_size: int) -> LossOutput:
    # A differentiable zero keeps backward() and the gradient all-reduce uniform across ranks.
    zero = sum(p.sum() * 0.0 for p in drafter.parameters())
    z = torch.zeros(block_size - 1)
    return LossOutput(zero, 0.0, 0.0, z, z.clone(), 0.0, 0, int(batch.lengths_B.sum()))


def dflash_loss(
    drafter,
    head,
    batch: TrainBatch,
    *,
    block_size: int,
    num_anchors: int,
    gamma: float = 0.0,
    ce_chunk_rows: int = 1024,
    generator: torch.Generator | None = None,
    topk: int = 0,
) -> LossOutput:
    """Weighted CE of the drafter's block predictions, as sums."""
    arch = getattr(drafter, "module", drafter).arch  # DDP wraps the module
    B = block_size
    gamma = gamma or default_gamma(B)
    anchors, valid = _anchor_table(batch, B, num_anchors, generator)
    if anchors.shape[1] == 0:
        return _zero_output(drafter, batch, B)
    N, A = anchors.shape
    param_dtype = next(getattr(drafter, "module", drafter).parameters()).dtype
    ids_NAB = block_input_ids(batch.input_ids_BS, anchors, B, arch.mask_token_id)
    embeds = head.embed(ids_NAB.flatten(1)).to(param_dtype)
    hidden = drafter(embeds, batch.hidden_BSD, anchors, batch.lengths_B).view(N, A, B, -1)

    labels, lmask = block_labels(batch, anchors, B)
    lmask = lmask * valid[:, :, None]
    k = torch.arange(1, B, device=anchors.device)
    weight = lmask * torch.exp(-(k - 1).float() / gamma)

    rows = valid  # only real anchors go through the LM head
    h_rows = hidden[:, :, 1:][rows].reshape(-1, hidden.shape[-1]).to(head.lm_head.weight.dtype)
    nll, pred, topk_hit = chunked_cross_entropy(
        h_rows, head.lm_head.weight, labels[rows].reshape(-1), ce_chunk_rows, topk
    )
    w = weight[rows].reshape(-1)
    m = lmask[rows].view(-1, B - 1)
    correct = (pred == labels[rows].reshape(-1)).float()
    correct_MK = correct.view(-1, B - 1) * m
    # Acceptance: the correct prefix stops at the first wrong (or unlabelled) position.
    accept = correct_MK.cumprod(dim=1).sum(dim=1) + 1
    return LossOutput(
        loss_sum=(nll * w).sum(),
        weight_sum=float(w.sum()),
        correct_sum=float((correct * w).sum()),
        per_pos_correct=correct_MK.sum(0).detach().cpu(),
        per_pos_count=m.sum(0).detach().cpu(),
        accept_len_sum=float(accept.sum()),
        num_blocks=int(rows.sum()),
        tokens=int(batch.lengths_B.sum()),
        topk_correct_sum=float((topk_hit.float() * w).sum()) if topk else 0.0,
    )


def decay_weights(block_size: int, gamma: float) -> list[float]:
    """exp(-(k-1)/gamma) for k = 1..B-1 (for docs and tests)."""
    return [math.exp(-(k - 1) / gamma) for k in range(1, block_size)]
