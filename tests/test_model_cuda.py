"""The CUDA-only drafter paths against their CPU twins (skipped without a CUDA device).

flex_attention (compiled, with the host-built BlockMask) vs the dense masked reference, outputs and
gradients; the pinned side-stream payload staging vs the plain conversion; one compiled training
step vs eager. CPU CI skips these; run them on a lent GPU: `pytest -q tests/test_model_cuda.py`.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from app.model.attention import block_attention, build_plan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda")


def _ranges(B=16, seqs=((700, 40), (300, 20), (1500, 60))):
    from app.model.packing import pack_blocks

    rng = np.random.default_rng(0)
    seq = np.repeat(np.arange(len(seqs)), [n for _, n in seqs])
    anchors = np.concatenate([np.sort(rng.choice(np.arange(1, L - B), n, replace=False)) for L, n in seqs])
    sub = pack_blocks(seq, anchors, np.array([L for L, _ in seqs]), max(L for L, _ in seqs), B, CUDA, "none",
                      align=128)
    return sub.plan.ctx_lo_M, sub.plan.ctx_hi_M, sub.plan.num_ctx


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
def test_flex_equals_dense_outputs_and_gradients(dtype, tol):
    B = 16
    lo, hi, T = _ranges(B)
    R = len(lo) * B
    g = torch.Generator(device=CUDA).manual_seed(0)
    q = torch.randn(8, R, 128, device=CUDA, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(2, T + R, 128, device=CUDA, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(2, T + R, 128, device=CUDA, dtype=dtype, generator=g).requires_grad_()
    w = torch.randn(8, R, 128, device=CUDA, dtype=dtype, generator=g)
    res = {}
    for kernel in ("dense", "flex"):
        out = block_attention(q, k, v, build_plan(lo, hi, T, B, CUDA, kernel), 128**-0.5)
        res[kernel] = (out.float(), *(t.float() for t in torch.autograd.grad((out * w).sum(), (q, k, v))))
    for a, b in zip(res["flex"], res["dense"]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_staged_payload_equals_plain_conversion():
    from app.messages import HiddenBatch
    from app.model.loss import TrainBatch
    from app.payload.staging import PayloadStager

    h = torch.randn(3, 50, 64).to(torch.bfloat16)
    a = h.view(torch.int16).numpy().view(np.uint16)
    a.setflags(write=False)
    hb = HiddenBatch(job_id=1, hidden_BSD=a, hidden_dtype="bfloat16", input_ids_BS=np.arange(150).reshape(3, 50),
                     loss_mask_BS=np.ones((3, 50), np.uint8), lengths_B=np.array([50, 40, 30]))
    stager = PayloadStager(CUDA, torch.bfloat16)
    for _ in range(3):  # both pinned buffers, then one reused
        staged = stager.ready(stager.stage(hb))
        plain = TrainBatch.from_hidden_batch(hb, CUDA, torch.bfloat16)
        for x, y in ((staged.hidden_BSD, plain.hidden_BSD), (staged.input_ids_BS, plain.input_ids_BS),
                     (staged.loss_mask_BS, plain.loss_mask_BS), (staged.lengths_B, plain.lengths_B)):
            assert x.dtype == y.dtype and torch.equal(x, y)


def test_compiled_training_step_matches_eager():
    from tests.toy import TOY_BLOCK as B, toy_drafter_parts

    from app.model.compiled import CompileCount, compile_layers, no_duck_shapes
    from app.model.loss import dflash_loss

    losses = []
    for compiled in (False, True):
        drafter, head, batch, arch = toy_drafter_parts(H=64)  # head_dim 16: compiled flex on CUDA refuses narrower
        assert arch.head_dim >= 16
        drafter, head = drafter.to(CUDA), head.to(CUDA)
        batch.input_ids_BS, batch.loss_mask_BS = batch.input_ids_BS.to(CUDA), batch.loss_mask_BS.to(CUDA)
        batch.hidden_BSD, batch.lengths_B = batch.hidden_BSD.to(CUDA), batch.lengths_B.to(CUDA)
        if compiled:
            compile_layers(drafter)
        with torch.autocast("cuda", dtype=torch.bfloat16), no_duck_shapes(), CompileCount() as count:
            out = dflash_loss(drafter, head, batch, block_size=B, num_anchors=7, max_rows=3 * B, backward=True,
                              generator=torch.Generator().manual_seed(3))
            first = count.graphs
            dflash_loss(drafter, head, batch, block_size=B, num_anchors=7, max_rows=5 * B, backward=True,
                        generator=torch.Generator().manual_seed(4))  # other sub-batch sizes: no recompile
        losses.append(out.loss_sum.item())
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    assert count.graphs == first and max(count.per_code.values(), default=0) <= 2, count.per_code


def test_flex_plan_built_on_cuda_equals_the_cpu_plan():
    """The plan's tensors reach the GPU in one pinned non-blocking copy; the same values as on CPU."""
    lo, hi, T = _ranges(16)
    gpu, cpu = (build_plan(lo, hi, T, 16, d, "flex").flex_mask for d in (CUDA, torch.device("cpu")))
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name
    assert torch.equal(gpu.to_dense().cpu(), cpu.to_dense())
