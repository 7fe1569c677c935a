"""A job's drafter cost, known from the data before any target runs: its query rows.

DFlash trains on blocks: a sequence contributes min(drafter.num_anchors, valid anchors) blocks of
block_size query rows, where a valid anchor is a position p with loss_mask[p] = 1 and p <= len - 2
(app/model/loss.py's sample_anchors: one label inside the sequence). Short sequences get an anchor at nearly every response
position, so a job of many short sequences costs the drafter far more than one of a few long ones.
The pool deals these costs across ranks so every rank's step costs about the same
(app/pool/pull_policy.py).
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from app.messages import JobSpec


# Tokens counted per pass: the prefix count is int64, 8 bytes per token, so one pass over a whole
# large dataset (800K records x ~1K tokens) would hold gigabytes in the driver; 4M tokens is 32 MB.
CHUNK_TOKENS = 1 << 22


def sequence_rows(loss_mask: np.ndarray, offsets: np.ndarray, block_size: int, num_anchors: int) -> np.ndarray:
    """Query rows of every sequence of a flat dataset (sequence i is [offsets[i], offsets[i+1])), a few
    million tokens at a time."""
    offsets = np.asarray(offsets, dtype=np.int64)
    out = np.empty(len(offsets) - 1, dtype=np.int64)
    lo = 0
    while lo < len(out):
        # Sequences lo..hi-1 span at most CHUNK_TOKENS tokens, or are one longer sequence.
        hi = max(lo + 1, int(np.searchsorted(offsets, offsets[lo] + CHUNK_TOKENS, side="right")) - 1)
        part = offsets[lo:hi + 1]
        out[lo:hi] = _rows(loss_mask[part[0]:part[-1]], part - part[0], block_size, num_anchors)
        lo = hi
    return out


def _rows(loss_mask: np.ndarray, offsets: np.ndarray, block_size: int, num_anchors: int) -> np.ndarray:
    starts, lengths = offsets[:-1], np.diff(offsets)
    cum = np.zeros(len(loss_mask) + 1, dtype=np.int64)
    np.cumsum(np.asarray(loss_mask) > 0, out=cum[1:])
    last = lengths - 2  # anchors at positions 0..last (sample_anchors: p + 1 < length)
    ends = starts + np.maximum(last + 1, 0)
    valid = np.where(last >= 0, cum[ends] - cum[starts], 0)
    return np.minimum(valid, num_anchors).astype(np.int64) * block_size


def with_costs(jobs: Iterable[JobSpec], seq_rows: np.ndarray) -> list[JobSpec]:
    """The jobs with `cost` = the sum of their sequences' query rows."""
    from dataclasses import replace

    return [replace(j, cost=int(seq_rows[list(j.seq_indices)].sum())) for j in jobs]
