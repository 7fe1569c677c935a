"""Packing a micro-batch's blocks flat and splitting them into row-bounded sub-batches.

A micro-batch (one target job) holds N sequences; DFlash samples up to `num_anchors` blocks of B
rows per sequence. Its cost is per query row, so the drafter never runs a job in one pass: the
blocks (grouped by sequence, sorted by anchor) are cut into sub-batches of at most `max_rows` rows.
Each sub-batch carries only real blocks (no padded anchors) and only the context tokens its blocks
can see: sequence n contributes positions [0, max_j min(p_j, len_n)), packed back to back.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from app.model.attention import FLEX_TILE, BlockPlan, build_plan


@dataclass
class PackedSubBatch:
    """One sub-batch: its blocks, the packed context it needs, RoPE positions and the attention plan."""

    seq_M: np.ndarray  # batch row (sequence) of each block
    anchors_M: np.ndarray  # anchor position of each block
    ctx_index_T: torch.Tensor  # flat indices into the job's [N*S] positions of the packed context
    q_pos_R: torch.Tensor  # RoPE positions of the block rows: p_j + 0..B-1
    k_pos_K: torch.Tensor  # RoPE positions of the keys: packed context, then the block rows
    plan: BlockPlan

    @property
    def num_rows(self) -> int:
        return self.plan.num_rows


def pack_blocks(seq_M, anchors_M, lengths_N, S: int, B: int, device: torch.device,
                kernel: str = "auto", align: int | None = None) -> PackedSubBatch:
    """Pack blocks (grouped by sequence, in the given order) with the context they can see.

    `align`: each sequence's context starts at a multiple of it, and so do the block keys (default:
    the flex tile on the flex kernel, so no 128x128 tile straddles two sequences' context or splits
    a tile's own block keys; 1 elsewhere). Padding slots repeat the sequence's first token, and no
    block ever sees them (its visible range ends at its anchor)."""
    if kernel == "auto":
        kernel = "flex" if device.type == "cuda" else "tiled"
    if align is None:
        align = FLEX_TILE if kernel == "flex" else 1
    seq_M = np.asarray(seq_M, dtype=np.int64)
    anchors_M = np.asarray(anchors_M, dtype=np.int64)
    lengths_N = np.asarray(lengths_N, dtype=np.int64)
    # Visible context of each block ends strictly before its anchor and never past the sequence.
    vis_M = np.minimum(anchors_M, lengths_N[seq_M])
    seqs, first = np.unique(seq_M, return_index=True)
    seqs = seqs[np.argsort(first)]  # order of appearance
    T_n = np.array([vis_M[seq_M == n].max() for n in seqs], dtype=np.int64)
    slot_n = -(-T_n // align) * align  # each sequence's slots, padded to the alignment
    off_n = np.concatenate([[0], np.cumsum(slot_n)[:-1]]).astype(np.int64)
    off_of = dict(zip(seqs.tolist(), off_n.tolist()))
    ctx_lo = np.array([off_of[n] for n in seq_M.tolist()], dtype=np.int64)
    ctx_hi = ctx_lo + vis_M
    T = int(slot_n.sum())
    ctx_pos = np.zeros(T, np.int64)
    ctx_index = np.zeros(T, np.int64)
    for n, t, off in zip(seqs.tolist(), T_n.tolist(), off_n.tolist()):
        ctx_pos[off:off + t] = np.arange(t)
        ctx_index[off:off + t] = n * S + np.arange(t)
        ctx_index[off + t:off + int(slot_n[seqs.tolist().index(n)])] = n * S  # padding: never visible
    q_pos = (anchors_M[:, None] + np.arange(B)).reshape(-1)
    plan = build_plan(ctx_lo, ctx_hi, T, B, device, kernel)
    return PackedSubBatch(
        seq_M, anchors_M,
        ctx_index_T=torch.from_numpy(ctx_index).to(device, non_blocking=True),
        q_pos_R=torch.from_numpy(q_pos).to(device, non_blocking=True),
        k_pos_K=torch.from_numpy(np.concatenate([ctx_pos, q_pos])).to(device, non_blocking=True),
        plan=plan,
    )


def split_rows(num_blocks: int, block_size: int, max_rows: int) -> list[slice]:
    """Consecutive block ranges of at most `max_rows` rows each (at least one block per range)."""
    per = max(1, int(max_rows) // block_size) if max_rows > 0 else max(1, num_blocks)
    return [slice(lo, min(num_blocks, lo + per)) for lo in range(0, num_blocks, per)]
