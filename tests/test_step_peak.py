"""The optimizer step's transient, measured on the trainer's own code (issue 37): `bench memory` counts it."""
from __future__ import annotations

import pytest
import torch

from app.bench.compute.step_peak import LiveBytes, measure_step_peak


def test_the_tracker_follows_allocations_and_frees() -> None:
    a = torch.zeros(1000)  # 4000 bytes
    mode = LiveBytes([a])
    assert mode.base == 4000
    with mode:
        b = a + 1  # +4000
        c = b * 2  # +4000: peak 12000
        del b, c
        d = a.view(10, 100)  # a view: no new storage
        assert mode.now() == 4000
    assert mode.peak == 12000 and d.shape == (10, 100)


def test_fused_adamw_adds_nothing_at_the_step_and_foreach_one_fp32_per_parameter() -> None:
    fused, foreach = measure_step_peak("fused"), measure_step_peak("foreach")
    assert fused.params == foreach.params > 10_000
    # AdamW itself: the fused kernel works in place; foreach keeps a sqrt of every exp_avg_sq (4 B/param).
    assert fused.adamw_per_param < 0.01 and foreach.adamw_per_param == pytest.approx(4.0, abs=0.01)
    # The whole finish_step: the flat all-reduce buffer beside the gradients (then freed), 4 B/param either way;
    # 8 would mean the old gradients stayed alive beside the buffer.
    assert fused.per_param == pytest.approx(4.0, abs=0.01) and foreach.per_param == pytest.approx(4.0, abs=0.01)
    with pytest.raises(ValueError, match="impl='sgd'"):
        measure_step_peak("sgd")
