"""The per-job delays of `faults.*` (no Ray): validated, off at 0, and inside each side's measured work."""
from __future__ import annotations

import pytest

from app.config.run_sections import FaultsConfig
from app.faults import injected_delay


def test_a_delay_sleeps_its_seconds_and_zero_is_off() -> None:
    slept: list[float] = []
    injected_delay(0.25, sleep=slept.append)
    injected_delay(0.0, sleep=slept.append)
    assert slept == [0.25]


@pytest.mark.parametrize("key", ["target_delay_s", "drafter_delay_s"])
@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_a_delay_must_be_finite_seconds_at_least_zero(key, bad) -> None:
    with pytest.raises(ValueError, match=rf"faults\.{key}=.* must be a finite number of seconds >= 0; set faults\.{key}=0"):
        FaultsConfig(**{key: bad})
    assert getattr(FaultsConfig(**{key: 1.5}), key) == 1.5


def test_the_drafter_delay_runs_in_every_micro_step(monkeypatch) -> None:
    import torch

    import app.training.trainer as trainer_mod
    from app.config.drafter_sections import DrafterConfig, TrainConfig
    from tests.toy import TOY_BLOCK, toy_drafter_parts

    drafter, head, batch, _ = toy_drafter_parts()
    delays: list[float] = []
    monkeypatch.setattr(trainer_mod, "injected_delay", delays.append)
    dcfg = DrafterConfig(num_layers=2, block_size=TOY_BLOCK, num_anchors=4, mask_token_id=3, ce_chunk_rows=16)
    trainer = trainer_mod.DrafterTrainer(drafter, head, dcfg, TrainConfig(sample_every=0), total_steps=2,
                                         device=torch.device("cpu"), delay_s=0.5)
    trainer.micro_step(batch, job_id=0)
    trainer.micro_step(batch, job_id=1)
    assert delays == [0.5, 0.5]
