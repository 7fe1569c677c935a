"""AdamW's implementation follows the device (issue 37): fused on CUDA, foreach on CPU, and a resume keeps
this device's choice whatever the checkpoint was written with. The fused kernel also runs on CPU, so the
two code paths are compared here, step by step."""
from __future__ import annotations

import copy

import pytest
import torch

import app.training.trainer as tr
from app.config.drafter_sections import DrafterConfig, TrainConfig
from tests.toy import TOY_BLOCK, toy_drafter_parts

CPU = torch.device("cpu")


def _trainer(monkeypatch, impl: str):
    """A toy trainer on CPU whose AdamW is `impl` ('foreach' as on CPU, 'fused' as on CUDA)."""
    fused = impl == "fused"
    monkeypatch.setattr(tr, "adamw_impl", lambda device: {"fused": fused, "foreach": not fused})
    drafter, head, batch, _ = toy_drafter_parts()
    dcfg = DrafterConfig(block_size=TOY_BLOCK, num_anchors=7, mask_token_id=3)
    tcfg = TrainConfig(compile="off", lr=1e-2, warmup_ratio=0.0, weight_decay=0.1)
    return tr.DrafterTrainer(drafter, head, dcfg, tcfg, total_steps=10, device=CPU), batch


def _steps(trainer, batch, n: int, first_job: int = 0) -> None:
    for j in range(first_job, first_job + n):
        trainer.micro_step(batch, job_id=j)
        assert trainer.finish_step().grad_norm > 0


def test_the_device_picks_the_implementation() -> None:
    assert tr.adamw_impl(CPU) == {"fused": False, "foreach": True}
    assert tr.adamw_impl(torch.device("cuda", 0)) == {"fused": True, "foreach": False}  # no GPU needed to decide
    drafter, head, _, _ = toy_drafter_parts()
    trainer = tr.DrafterTrainer(drafter, head, DrafterConfig(block_size=TOY_BLOCK, num_anchors=7, mask_token_id=3),
                                TrainConfig(compile="off"), total_steps=10, device=CPU)
    group = trainer.optimizer.param_groups[0]
    assert group["foreach"] is True and group["fused"] is False


def test_fused_and_foreach_steps_agree(monkeypatch) -> None:
    runs = {}
    for impl in ("foreach", "fused"):
        trainer, batch = _trainer(monkeypatch, impl)
        _steps(trainer, batch, 3)
        runs[impl] = [p.detach().clone() for p in trainer.drafter.parameters()]
    moved = max(float((a - b.detach()).abs().max()) for a, b in zip(runs["foreach"], toy_drafter_parts()[0].parameters()))
    assert moved > 1e-3  # the steps did move the weights
    for a, b in zip(runs["foreach"], runs["fused"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("saved,resumed", [("foreach", "fused"), ("fused", "foreach")])
def test_a_resume_keeps_this_devices_implementation(monkeypatch, saved, resumed) -> None:
    """A checkpoint written on CPU (foreach) and resumed on CUDA must run fused there, and the other way
    round: the saved param groups' flags are replaced, and the next step equals the uninterrupted one."""
    writer, batch = _trainer(monkeypatch, saved)
    _steps(writer, batch, 2)
    opt_state, weights = copy.deepcopy(writer.optimizer.state_dict()), writer.drafter.state_dict()  # not views
    sched, weights = writer.scheduler.state_dict(), {k: v.clone() for k, v in weights.items()}
    _steps(writer, batch, 1, first_job=2)
    reader, _ = _trainer(monkeypatch, resumed)
    reader.drafter.load_state_dict(weights)
    reader.optimizer.load_state_dict(opt_state)
    reader.scheduler.load_state_dict(sched)
    group = reader.optimizer.param_groups[0]
    assert group["fused"] is (resumed == "fused") and group["foreach"] is (resumed == "foreach")
    steps = {reader.optimizer.state[p]["step"].dtype for p in reader.drafter.parameters()}
    assert steps == {torch.float32}
    reader.step = 2
    _steps(reader, batch, 1, first_job=2)
    for a, b in zip(writer.drafter.parameters(), reader.drafter.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
