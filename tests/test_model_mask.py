"""The DFlash block mask and RoPE positions against a plain-loop construction from the rules."""
from __future__ import annotations

import torch

from app.model.mask import block_mask, block_positions, key_positions


def _loop_mask(anchors, S, B, lengths):
    N, A = len(anchors), len(anchors[0])
    out = []
    for n in range(N):
        rows = []
        for j in range(A):
            for i in range(B):
                row = []
                for s in range(S):  # context: strictly before the anchor, never padding
                    row.append(s < anchors[n][j] and s < lengths[n])
                for j2 in range(A):  # blocks: only its own, both ways
                    for _ in range(B):
                        row.append(j2 == j)
                rows.append(row)
        out.append(rows)
    return torch.tensor(out)


def test_block_mask_equals_loop_construction():
    anchors = [[0, 3, 5], [2, 2, 7]]
    lengths = [12, 6]
    got = block_mask(torch.tensor(anchors), 12, 4, torch.tensor(lengths))
    assert got.shape == (2, 12, 12 + 12)
    assert torch.equal(got, _loop_mask(anchors, 12, 4, lengths))


def test_anchor_position_itself_is_hidden_and_previous_visible():
    m = block_mask(torch.tensor([[5]]), 10, 3)
    assert not m[0, :, 5].any()  # `<`, not `<=`: the anchor's own context position is unseen
    assert m[0, :, 4].all()
    assert m[0, :, 10:].all()  # own block bidirectional (not causal)


def test_positions_are_context_then_anchor_offsets():
    anchors = torch.tensor([[2, 6]])
    assert block_positions(anchors, 3).tolist() == [[2, 3, 4, 6, 7, 8]]
    assert key_positions(anchors, 5, 3).tolist() == [[0, 1, 2, 3, 4, 2, 3, 4, 6, 7, 8]]
