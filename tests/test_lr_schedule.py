"""Issue 12 item 6: the LR schedule runs on jobs consumed, so drains (smaller steps) never train at LR 0."""
from __future__ import annotations

import pytest
import torch

from app.config.drafter_sections import DrafterConfig, TrainConfig
from app.model.drafter import DFlashDrafter
from app.model.loss import TrainBatch
from app.model.target_head import TargetHead
from tests.toy import tiny_arch
from app.training.trainer import DrafterTrainer, warmup_cosine

BLOCK = 4


@pytest.fixture(scope="module")
def parts(vocab64_target):
    config, target_dir = vocab64_target
    arch = tiny_arch(config, num_layers=1, block_size=BLOCK, mask_token_id=3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 64, (2, 24), generator=g)
    mask = torch.ones(2, 24)
    mask[:, :8] = 0
    batch = TrainBatch(ids, mask, torch.randn(2, 24, arch.feature_dim, generator=g), torch.full((2,), 24))
    return arch, TargetHead.load(target_dir), batch


def _lrs(parts, total_jobs: int, steps: int) -> list[float]:
    """Planned: 4 steps of 2 jobs (8 jobs). Run: every step drained to a single job."""
    arch, head, batch = parts
    torch.manual_seed(0)
    dcfg = DrafterConfig(num_layers=1, block_size=BLOCK, num_anchors=4, mask_token_id=3, ce_chunk_rows=16)
    tcfg = TrainConfig(lr=1.0, warmup_ratio=0.0, grad_accum=2, sample_every=0)
    trainer = DrafterTrainer(DFlashDrafter(arch), head, dcfg, tcfg, total_steps=4, device=torch.device("cpu"),
                             total_jobs=total_jobs)
    lrs = []
    for job in range(steps):
        trainer.micro_step(batch, job_id=job)
        lrs.append(trainer.finish_step().lr)
    return lrs


def test_half_size_steps_keep_a_positive_lr_until_the_last_job(parts) -> None:
    lrs = _lrs(parts, total_jobs=8, steps=8)
    expect = [warmup_cosine(8, 0.0)(j) for j in range(8)]  # the LR of the step that starts after j jobs
    assert lrs == pytest.approx(expect)
    assert all(lr > 0 for lr in lrs)


def test_full_steps_follow_the_same_curve_by_jobs(parts) -> None:
    """Two jobs per step: the step-based and the job-based schedules agree at the step boundaries."""
    arch, head, batch = parts
    torch.manual_seed(0)
    dcfg = DrafterConfig(num_layers=1, block_size=BLOCK, num_anchors=4, mask_token_id=3, ce_chunk_rows=16)
    tcfg = TrainConfig(lr=1.0, warmup_ratio=0.0, grad_accum=2, sample_every=0)
    trainer = DrafterTrainer(DFlashDrafter(arch), head, dcfg, tcfg, total_steps=4, device=torch.device("cpu"),
                             total_jobs=8)
    lrs = []
    for step in range(4):
        trainer.micro_step(batch, job_id=2 * step)
        trainer.micro_step(batch, job_id=2 * step + 1)
        lrs.append(trainer.finish_step().lr)
    assert lrs == pytest.approx([warmup_cosine(4, 0.0)(s) for s in range(4)])


def test_step_schedule_would_hit_zero_half_way(parts) -> None:
    """What the job-based schedule fixes: by steps, the second half of the data trained at LR 0."""
    lrs = _lrs(parts, total_jobs=0, steps=8)
    assert lrs[4:] == pytest.approx([0.0] * 4)
