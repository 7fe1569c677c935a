"""Compiled drafter paths on CPU (issue 23, item 6): dynamic shapes compile once, whatever the sizes.

Dynamo's duck sizing specialized a first sub-batch whose row count equalled the hidden size, or whose
BlockMask tile count equalled the head count, and recompiled on the next one. `CompileCount` counts
graphs per code object; the counting backend (no codegen) keeps these fast, and one test compiles a
real training step with inductor against eager.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounter

from app.model import attention
from app.model.compiled import CompileCount, compile_layers, no_duck_shapes
from app.model.loss import dflash_loss
from app.model.packing import pack_blocks
from tests.toy import TOY_BLOCK, toy_drafter_parts

CPU = torch.device("cpu")
pytestmark = pytest.mark.slow  # torch.compile on a shared CPU: tens of seconds each


def _flex_plan(seqs, B=16, seed=0):
    rng = np.random.default_rng(seed)
    seq = np.repeat(np.arange(len(seqs)), [n for _, n in seqs])
    anchors = np.concatenate([np.sort(rng.choice(np.arange(1, L - B), n, replace=False)) for L, n in seqs])
    return pack_blocks(seq, anchors, np.array([L for L, _ in seqs]), max(L for L, _ in seqs), B, CPU, "flex").plan


# The first plan has 4 query tiles, as many as the heads: the old compile specialized it.
PLANS = [((300, 32),), ((700, 40), (300, 20)), ((1500, 60),), ((200, 10), (400, 9)), ((900, 30), (500, 10), (300, 5))]


def test_flex_compiles_one_graph_over_many_plans():
    from torch.nn.attention.flex_attention import flex_attention

    fn = attention.compiled_flex(backend=CompileCounter())
    g = torch.Generator().manual_seed(0)
    calls = []
    for seqs in PLANS:
        plan = _flex_plan(seqs)
        R, K = plan.num_rows, plan.num_ctx + plan.num_rows
        qkv = torch.randn(1, 4, R, 16, generator=g), torch.randn(1, 2, K, 16, generator=g), \
            torch.randn(1, 2, K, 16, generator=g)
        calls.append((qkv, plan.flex_mask))
    assert calls[0][1].kv_num_blocks.shape[-1] == 4  # the case that specialized
    with CompileCount() as count:
        outs = [fn(*qkv, block_mask=mask, scale=0.25, enable_gqa=True) for qkv, mask in calls]
    for out, (qkv, mask) in zip(outs, calls):  # eager flex compiles a wrapper of its own: counted apart
        torch.testing.assert_close(out, flex_attention(*qkv, block_mask=mask, scale=0.25, enable_gqa=True))
    assert count.graphs == 1 and count.recompiled == {}, count.per_code


def _step(drafter, head, batch, rows: int, seed: int):
    drafter.zero_grad(set_to_none=True)
    with no_duck_shapes():
        out = dflash_loss(drafter, head, batch, block_size=TOY_BLOCK, num_anchors=7, max_rows=rows,
                          backward=True, generator=torch.Generator().manual_seed(seed))
    return out.loss_sum.item(), [p.grad.clone() for p in drafter.parameters()]


def test_compiled_layers_compile_each_code_once_over_many_sub_batch_sizes():
    drafter, head, batch, arch = toy_drafter_parts(H=64)
    compile_layers(drafter, backend=CompileCounter())
    with CompileCount() as count:
        _step(drafter, head, batch, rows=arch.hidden_size, seed=3)  # first sub-batch: rows == hidden
        first = count.graphs
        for i, rows in enumerate((12 * TOY_BLOCK, 8 * TOY_BLOCK, 20 * TOY_BLOCK, 5 * TOY_BLOCK)):
            _step(drafter, head, batch, rows=rows, seed=4 + i)
    # At most two graphs per code: layer 0's input needs no grad, the later layers' inputs do (a guard
    # Dynamo keeps); duck sizing made it four. Nothing compiles after the first micro-batch.
    assert count.graphs == first and max(count.per_code.values()) <= 2, count.per_code


@pytest.mark.slow
def test_train_compile_on_cpu_matches_eager_losses_and_grads_and_compiles_once(monkeypatch):
    """`train.compile=on` on CPU: DrafterTrainer compiles the layers (forward and backward graphs through
    AOT autograd; aot_eager, since inductor's C++ builds take minutes on a shared 2-core box, and the
    CUDA test compiles with inductor); two micro-batches give eager's loss and gradients, no recompile."""
    from app.config.drafter_sections import DrafterConfig, TrainConfig
    from app.model import compiled
    from app.training.trainer import DrafterTrainer

    monkeypatch.setattr(compiled, "LAYER_BACKEND", "aot_eager")
    results = {}
    for mode in ("off", "on"):
        drafter, head, batch, arch = toy_drafter_parts(H=64)
        dcfg = DrafterConfig(block_size=TOY_BLOCK, num_anchors=7, max_rows=16 * TOY_BLOCK, mask_token_id=3)
        trainer = DrafterTrainer(drafter, head, dcfg, TrainConfig(compile=mode), total_steps=10, device=CPU)
        with CompileCount() as count:
            losses, grads = [], []
            for job in (1, 2):
                drafter.zero_grad(set_to_none=True)
                trainer.micro_step(batch, job_id=job)
                losses.append(trainer.acc.sums["loss_sum"])
                grads.append([p.grad.clone() for p in drafter.parameters()])
        results[mode] = (losses, grads, count)
    (l_eager, g_eager, _), (l_comp, g_comp, count) = results["off"], results["on"]
    assert l_comp == pytest.approx(l_eager, rel=1e-4)
    for a, b in zip(sum(g_comp, []), sum(g_eager, [])):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    assert count.graphs > 0 and max(count.per_code.values()) <= 2, count.per_code
