"""The DFlash training sample and loss: anchors, same-position labels, decay-weighted chunked CE.

Returns SUMS (loss, weights, correct counts), not means: the trainer all-reduces the weight sum
across ranks and micro-batches and divides the gradients by it, so every token weighs the same.

Everything about the sample is decided on the host from the host copy of the job (anchors, labels,
weights): no per-sequence device syncs. The blocks are packed flat (no padded anchors) and run in
sub-batches of at most `max_rows` query rows (`app/model/packing.py`); since the loss is a sum, a
sub-batched backward gives the same gradients as one pass. Device-side metrics are gathered into
one tensor and read back once per micro-batch.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from app.config.drafter_sections import default_gamma


@dataclass
class TrainBatch:
    """One micro-batch on the drafter's device: token ids, loss mask, target features, lengths."""

    input_ids_BS: torch.Tensor  # long
    loss_mask_BS: torch.Tensor  # float, 0 on padding
    hidden_BSD: torch.Tensor  # target features, k*H wide
    lengths_B: torch.Tensor  # long
    # Host copies (numpy or CPU tensors) for sampling and labels without device syncs; None = .cpu().
    input_ids_host: object = None
    loss_mask_host: object = None
    lengths_host: object = None
    ready_event: object = None  # CUDA: the staging copy's event (app/payload/staging.py)

    def host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input_ids [N, S] int64, loss_mask [N, S] float32, lengths [N] int64) on the host."""
        ids = self.input_ids_host if self.input_ids_host is not None else self.input_ids_BS.cpu()
        mask = self.loss_mask_host if self.loss_mask_host is not None else self.loss_mask_BS.cpu()
        lens = self.lengths_host if self.lengths_host is not None else self.lengths_B.cpu()
        return (np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.float32), np.asarray(lens, dtype=np.int64))

    @classmethod
    def from_hidden_batch(cls, hb, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "TrainBatch":
        """From an `app.messages.HiddenBatch` (read-only numpy, bf16 as a uint16 view)."""
        return cls(
            input_ids_BS=_to_torch(hb.input_ids_BS, device, torch.long),
            loss_mask_BS=_to_torch(hb.loss_mask_BS, device, torch.float32),
            hidden_BSD=_hidden_to_torch(hb.hidden_BSD, hb.hidden_dtype, device, dtype, hb.hidden_scale_BS),
            lengths_B=_to_torch(hb.lengths_B, device, torch.long),
            input_ids_host=np.asarray(hb.input_ids_BS), loss_mask_host=np.asarray(hb.loss_mask_BS),
            lengths_host=np.asarray(hb.lengths_B),
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


def _hidden_to_torch(a: np.ndarray, hidden_dtype: str, device, dtype, scales: np.ndarray | None = None) -> torch.Tensor:
    if hidden_dtype == "float8_e4m3":  # codes and per-token scales, decoded on `device` (a fresh tensor)
        from app.model.feature_codec import decode_numpy

        return decode_numpy(np.asarray(a), np.asarray(scales), dtype, device)
    if hidden_dtype == "bfloat16":
        t = _readonly_view(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = _readonly_view(a)
    return _copy_to(t, device, dtype)


def sample_anchors(
    loss_mask_S: torch.Tensor, length: int, block_size: int, num_anchors: int, generator: torch.Generator | None
) -> torch.Tensor:
    """Up to `num_anchors` sorted positions p with loss_mask[p] == 1 and p <= length - 2, no repeats.

    A block needs one label inside the sequence (p + 1 < length), not all B - 1: labels past the end are
    masked (`packed_labels`), so the answer's last tokens and its EOS are first-position labels too (with
    p <= length - B, the last B - 1 tokens of every answer never were). `block_size` is kept for callers."""
    last = int(length) - 2
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
    `per_pos_*` are unweighted counts over positions with loss_mask 1. `loss_sum` is differentiable
    unless the loss already ran backward itself (`backward=True`), then it is detached."""

    loss_sum: torch.Tensor  # sum of weight x CE
    weight_sum: float
    correct_sum: float
    per_pos_correct: torch.Tensor  # [B-1], block positions 1..B-1
    per_pos_count: torch.Tensor  # [B-1]
    accept_len_sum: float  # sum over blocks of (correct prefix + 1)
    num_blocks: int
    tokens: int  # real tokens in the batch
    topk_correct_sum: float = 0.0
    num_sub_batches: int = 0
    # Sum of weight x the FULL vocabulary's CE of the same rows, when a sampled-softmax step measured it
    # (`full_check`); -1 when not measured. With the full head it equals loss_sum.
    full_loss_sum: float = -1.0


def sample_blocks(loss_mask_NS, lengths_N, block_size: int, num_anchors: int, generator) -> tuple[np.ndarray, np.ndarray]:
    """(sequence of each block, anchor of each block), grouped by sequence, anchors sorted; host only."""
    mask = torch.as_tensor(np.asarray(loss_mask_NS, dtype=np.float32))
    seq, anchors = [], []
    for n in range(mask.shape[0]):
        a = sample_anchors(mask[n], int(lengths_N[n]), block_size, num_anchors, generator).numpy()
        seq.append(np.full(len(a), n, dtype=np.int64))
        anchors.append(a.astype(np.int64))
    if not seq:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(seq), np.concatenate(anchors)


def packed_labels(ids_NS: np.ndarray, mask_NS: np.ndarray, lengths_N: np.ndarray, seq_M: np.ndarray,
                  anchors_M: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Labels and label mask [M, B-1]: output k of block j predicts input_ids[p_j + k] (the same
    position, no shift), k = 1..B-1; the mask is loss_mask there and 0 past the length."""
    pos = anchors_M[:, None] + np.arange(1, block_size)
    in_seq = pos < lengths_N[seq_M][:, None]
    pos_c = np.minimum(pos, ids_NS.shape[1] - 1)
    labels = ids_NS[seq_M[:, None], pos_c]
    lmask = mask_NS[seq_M[:, None], pos_c] * in_seq
    return labels, lmask.astype(np.float32)


def block_labels(batch: TrainBatch, anchors_NA: torch.Tensor, block_size: int):
    """`packed_labels` for an [N, A] anchor table (every anchor real): labels, mask [N, A, B-1]."""
    ids, mask, lens = batch.host()
    N, A = anchors_NA.shape
    seq = np.repeat(np.arange(N), A)
    labels, lmask = packed_labels(ids, mask, lens, seq, anchors_NA.cpu().numpy().reshape(-1), block_size)
    return torch.from_numpy(labels).view(N, A, -1), torch.from_numpy(lmask).view(N, A, -1)


def _zero_output(drafter, tokens: int, block_size: int, backward: bool) -> LossOutput:
    # A differentiable zero keeps backward() and the gradient all-reduce uniform across ranks.
    zero = sum(p.sum() * 0.0 for p in drafter.parameters())
    if backward:
        zero.backward()
        zero = zero.detach()
    z = torch.zeros(block_size - 1)
    return LossOutput(zero, 0.0, 0.0, z, z.clone(), 0.0, 0, tokens)


def _compute_dtype(module, device: torch.device) -> torch.dtype:
    """The dtype activations run in: autocast's when it is on, else the parameters'."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return next(module.parameters()).dtype


def dflash_loss(
    drafter,
    head,
    batch: TrainBatch,
    *,
    block_size: int,
    num_anchors: int,
    gamma: float | None = None,
    ce_chunk_rows: int = 1024,
    generator: torch.Generator | None = None,
    topk: int = 0,
    max_rows: int = 0,
    backward: bool = False,
    kernel: str = "auto",
    negatives: int = 0,
    full_check: bool = False,
) -> LossOutput:
    """Weighted CE of the drafter's block predictions, as sums.

    `max_rows` > 0 bounds the query rows per sub-batch (0 = the whole job in one pass). With
    `backward=True` each sub-batch backpropagates before the next one runs (so only one sub-batch's
    activations are alive) and the returned `loss_sum` is detached; otherwise it is differentiable.
    `gamma` None: DFlash's default for `block_size` (a run passes `DrafterConfig.gamma`).
    `negatives` > 0 trains the head's softmax on a sampled slice of the vocabulary (`drafter.loss_negatives`,
    app/model/vocab_sample.py); `full_check` then also computes the full vocabulary's loss, argmax and top-k of
    the same rows (no gradient) for the metrics. With 0 the full head is the loss, as before.
    """
    module = getattr(drafter, "module", drafter)  # DDP wraps the module
    arch, B = module.arch, block_size
    device = batch.input_ids_BS.device
    ids_h, mask_h, lens_h = batch.host()
    tokens = int(lens_h.sum())
    seq_M, anchors_M = sample_blocks(mask_h, lens_h, B, num_anchors, generator)
    if len(seq_M) == 0:
        return _zero_output(drafter, tokens, B, backward)
    from app.model.chunked_ce import full_nll_argmax, sampled_weighted_ce, weighted_chunked_ce
    from app.model.packing import pack_blocks, split_rows
    from app.model.vocab_sample import vocab_slice

    labels_h, lmask_h = packed_labels(ids_h, mask_h, lens_h, seq_M, anchors_M, B)
    weight_h = lmask_h * decay_weights(B, default_gamma(B) if gamma is None else gamma)
    block_ids_h = np.full((len(seq_M), B), arch.mask_token_id, dtype=np.int64)
    block_ids_h[:, 0] = ids_h[seq_M, anchors_M]
    N, S = ids_h.shape
    feats_TD = batch.hidden_BSD.reshape(N * S, -1)
    dtype = _compute_dtype(module, device)
    loss_total = None
    dev_stats = []  # per sub-batch: [correct_w, accept, topk_w] and per-position correct counts
    subs = split_rows(len(seq_M), B, max_rows)
    for sl in subs:
        sub = pack_blocks(seq_M[sl], anchors_M[sl], lens_h, S, B, device, kernel)
        ids = torch.from_numpy(block_ids_h[sl]).to(device, non_blocking=True)
        labels = torch.from_numpy(labels_h[sl]).to(device, non_blocking=True)
        lmask = torch.from_numpy(lmask_h[sl]).to(device, non_blocking=True)
        w = torch.from_numpy(weight_h[sl]).to(device, non_blocking=True)
        embeds_RH = head.embed(ids.reshape(-1)).to(dtype)
        hidden_RH = module.forward_packed(embeds_RH, feats_TD[sub.ctx_index_T], sub)
        h_rows = hidden_RH.view(-1, B, hidden_RH.shape[-1])[:, 1:].reshape(-1, hidden_RH.shape[-1])
        h_rows, W, flat_labels, flat_w = h_rows.to(head.lm_head.weight.dtype), head.lm_head.weight, labels.reshape(-1), w.reshape(-1)
        full_w = None
        if negatives > 0:
            vslice = vocab_slice(labels_h[sl].reshape(-1), (arch.mask_token_id,), W.shape[0], negatives, generator, device)
            loss, _, pred = sampled_weighted_ce(h_rows, W, vslice, flat_w, ce_chunk_rows)
            topk_hit = torch.zeros_like(pred, dtype=torch.bool)
            if full_check:  # the exact figures of the same rows: the metrics use them, the loss stays sampled
                full_nll, pred, topk_hit = full_nll_argmax(h_rows.detach(), W, flat_labels, ce_chunk_rows, topk)
                full_w = (full_nll * flat_w.float()).sum()
        else:
            loss, _, pred, topk_hit = weighted_chunked_ce(h_rows, W, flat_labels, flat_w, ce_chunk_rows, topk)
            full_w = loss.detach()
        if backward:
            loss.backward()
            loss = loss.detach()
        loss_total = loss if loss_total is None else loss_total + loss
        with torch.no_grad():
            correct = (pred.view(labels.shape) == labels).float()
            correct_MK = correct * lmask
            # Acceptance: the correct prefix stops at the first wrong (or unlabelled) position.
            accept = correct_MK.cumprod(dim=1).sum(dim=1) + 1
            topk_w = (topk_hit.view(labels.shape).float() * w).sum() if topk else torch.zeros((), device=device)
            full = full_w if full_w is not None else torch.full((), -1.0, device=device)
            dev_stats.append(torch.cat([torch.stack([(correct * w).sum(), accept.sum(), topk_w, full.float()]),
                                        correct_MK.sum(0)]))
    stats = torch.stack(dev_stats).sum(0).double().cpu()  # the one device sync of the micro-batch
    return LossOutput(
        loss_sum=loss_total,
        weight_sum=float(weight_h.sum(dtype=np.float64)),
        correct_sum=float(stats[0]),
        per_pos_correct=stats[4:].float(),
        per_pos_count=torch.from_numpy(lmask_h.sum(0)),
        accept_len_sum=float(stats[1]),
        num_blocks=len(seq_M),
        tokens=tokens,
        topk_correct_sum=float(stats[2]) if topk else 0.0,
        num_sub_batches=len(subs),
        full_loss_sum=float(stats[3]) if (negatives <= 0 or full_check) else -1.0,
    )


def decay_weights(block_size: int, gamma: float) -> np.ndarray:
    """The loss weight of each predicted position k = 1..B-1 of a block: exp(-(k-1)/gamma), float32."""
    assert gamma > 0, gamma  # DrafterConfig.gamma resolves the config's 0 to the block's default
    return np.exp(-np.arange(block_size - 1, dtype=np.float64) / gamma).astype(np.float32)
