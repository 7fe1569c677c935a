"""The CUDA drafter path rehearsed on CPU (issue 23): the whole drafter loss with the flex layout
(128-aligned context, host-built BlockMask) against the tiled and dense paths, fp32 and bf16.

Forward: eager flex_attention itself. Backward: flex has none on CPU, so the same BlockMask is applied
as flex applies it (partial tiles through its mask_mod, full tiles whole, every other tile skipped) in
a masked SDPA; what the rehearsal checks is the layout and the mask, the kernel is torch's. On CUDA
the compiled kernel runs both ways (tests/test_model_cuda.py)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from app.model import attention
from app.model.loss import dflash_loss
from tests.toy import TOY_BLOCK, toy_drafter_parts


def _tiles(num, idx, i):
    return idx[0, 0, i, : int(num[0, 0, i])].tolist()


def block_mask_as_flex_applies_it(mask, R: int, K: int) -> torch.Tensor:
    """[R, K] visibility: partial tiles through mask_mod, full tiles entirely, the rest never."""
    t = attention.FLEX_TILE
    q_idx, kv_idx = torch.arange(R)[:, None], torch.arange(K)[None, :]
    mod = mask.mask_mod(0, 0, q_idx, kv_idx)
    out = torch.zeros(R, K, dtype=torch.bool)
    for i in range(mask.kv_num_blocks.shape[-1]):
        rows = slice(i * t, min(R, (i + 1) * t))
        for j in _tiles(mask.kv_num_blocks, mask.kv_indices, i):
            out[rows, j * t:(j + 1) * t] = mod[rows, j * t:(j + 1) * t]
        for j in _tiles(mask.full_kv_num_blocks, mask.full_kv_indices, i):
            out[rows, j * t:(j + 1) * t] = True
    return out


def _flex_layout_sdpa(q, k, v, plan, scale):
    visible = block_mask_as_flex_applies_it(plan.flex_mask, q.shape[1], k.shape[1])
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=visible, scale=scale,
                                          enable_gqa=q.shape[0] != k.shape[0])[0]


def _loss_and_grads(kernel: str, dtype: torch.dtype, backward: bool = True):
    drafter, head, batch, _ = toy_drafter_parts(H=64)  # head_dim 16, as flex on CUDA needs
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32), \
            torch.set_grad_enabled(backward):
        warnings.simplefilter("ignore", UserWarning)  # eager flex warns that it is unfused
        out = dflash_loss(drafter, head, batch, block_size=TOY_BLOCK, num_anchors=7, max_rows=8 * TOY_BLOCK,
                          backward=backward, kernel=kernel, generator=torch.Generator().manual_seed(3))
    return out.loss_sum.item(), [p.grad.clone() for p in drafter.parameters()] if backward else []


TOL = [(torch.float32, 1e-5, 1e-6), (torch.bfloat16, 2e-2, 3e-2)]


@pytest.mark.parametrize("dtype,rel,atol", TOL)
def test_eager_flex_drafter_loss_equals_tiled_and_dense(dtype, rel, atol):
    flex, _ = _loss_and_grads("flex", dtype, backward=False)
    for other in ("tiled", "dense"):
        assert flex == pytest.approx(_loss_and_grads(other, dtype, backward=False)[0], rel=rel), other


@pytest.mark.parametrize("dtype,rel,atol", TOL)
def test_flex_layout_drafter_loss_and_grads_equal_tiled_and_dense(dtype, rel, atol, monkeypatch):
    real = attention.block_attention

    def flex_or_real(q, k, v, plan, scale):
        return _flex_layout_sdpa(q, k, v, plan, scale) if plan.kernel == "flex" else real(q, k, v, plan, scale)

    monkeypatch.setattr(attention, "block_attention", flex_or_real)
    flex = _loss_and_grads("flex", dtype)
    for other in ("tiled", "dense"):
        loss, grads = _loss_and_grads(other, dtype)
        assert flex[0] == pytest.approx(loss, rel=rel), other
        for a, b in zip(flex[1], grads):
            torch.testing.assert_close(a.float(), b.float(), rtol=rel, atol=atol * max(1.0, float(b.abs().max())))
