"""The DFlash block attention mask and RoPE positions for a batch of sequences with many anchors.

Layout per sequence: queries are the A blocks of B positions each, flattened to A*B rows (row
j*B + i is position i of block j). Keys are the S context positions followed by the same A*B block
positions. A query in block j sees context positions strictly before its anchor p_j (never p_j
itself: that token's target features already encode the next token) and every position of its own
block, both ways; nothing of another block.
"""
from __future__ import annotations

import torch


def block_mask(
    anchors_NA: torch.Tensor,
    context_len: int,
    block_size: int,
    lengths_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask [N, A*B, S + A*B]; True = the query may attend to that key."""
    N, A = anchors_NA.shape
    B, S = block_size, context_len
    device = anchors_NA.device
    anchor_NQ = anchors_NA.repeat_interleave(B, dim=1)  # each query row's anchor
    ctx_pos = torch.arange(S, device=device)
    ctx_vis = ctx_pos[None, None, :] < anchor_NQ[:, :, None]  # strictly before p_j
    if lengths_N is not None:
        ctx_vis = ctx_vis & (ctx_pos[None, None, :] < lengths_N[:, None, None])  # padding unseen
    block_id = torch.arange(A, device=device).repeat_interleave(B)
    own = block_id[:, None] == block_id[None, :]  # [A*B, A*B], the same for every sequence
    return torch.cat([ctx_vis, own[None].expand(N, -1, -1)], dim=2)


def block_positions(anchors_NA: torch.Tensor, block_size: int) -> torch.Tensor:
    """RoPE positions of the query rows: p_j + 0..B-1, shape [N, A*B]."""
    offs = torch.arange(block_size, device=anchors_NA.device)
    return (anchors_NA[:, :, None] + offs).flatten(1)


def key_positions(anchors_NA: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """RoPE positions of the keys: 0..S-1 for the context, then the block positions; [N, S + A*B]."""
    N = anchors_NA.shape[0]
    ctx = torch.arange(context_len, device=anchors_NA.device).expand(N, -1)
    return torch.cat([ctx, block_positions(anchors_NA, block_size)], dim=1)
