"""A run of a sweep reads its own target layers out of a payload that carries the union of the runs'."""
from __future__ import annotations

import dataclasses

import numpy as np

from app.messages import HiddenBatch


def layer_columns(captured: list[int], wanted: list[int]) -> list[int] | None:
    """Positions of `wanted` among the `captured` layers of a payload; None when they are the same."""
    if list(captured) == list(wanted):
        return None
    missing = [layer for layer in wanted if layer not in captured]
    assert not missing, f"layers {missing} are not captured ({captured})"
    return [list(captured).index(layer) for layer in wanted]


def select_layers(batch: HiddenBatch, positions: list[int], num_captured: int) -> HiddenBatch:
    """The batch with only the layers at `positions` (of `num_captured` concatenated along the last
    dim), in that order. An FP8 payload's per-token scale covers every layer, so it stays valid."""
    width = batch.hidden_BSD.shape[-1] // num_captured
    parts = [batch.hidden_BSD[..., p * width:(p + 1) * width] for p in positions]
    return dataclasses.replace(batch, hidden_BSD=np.ascontiguousarray(np.concatenate(parts, axis=-1)))
