"""Packed, row-bounded sub-batches: same loss and gradients as one padded pass; bf16 activations."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from app.config.drafter_sections import default_gamma
from app.model.chunked_ce import full_cross_entropy, weighted_chunked_ce
from app.model.layers import MLP, RMSNorm
from app.model.loss import TrainBatch, dflash_loss, packed_labels, sample_blocks
from tests.toy import TOY_BLOCK, toy_drafter_parts

B = TOY_BLOCK


def _grads(drafter):
    return [p.grad.clone() for p in drafter.parameters()]


def _loss(drafter, head, batch, **kw):
    drafter.zero_grad(set_to_none=True)
    return dflash_loss(drafter, head, batch, block_size=B, num_anchors=7, ce_chunk_rows=5,
                       generator=torch.Generator().manual_seed(3), **kw)


def test_sub_batched_gradients_equal_one_pass():
    drafter, head, batch, _ = toy_drafter_parts()
    one = _loss(drafter, head, batch, max_rows=0, backward=True)
    g_one = _grads(drafter)
    many = _loss(drafter, head, batch, max_rows=3 * B, backward=True)  # 3 blocks per sub-batch
    g_many = _grads(drafter)
    assert one.num_sub_batches == 1 and many.num_sub_batches == -(-one.num_blocks // 3) > 3
    assert many.loss_sum.item() == pytest.approx(one.loss_sum.item(), rel=1e-5)
    assert many.weight_sum == one.weight_sum and many.correct_sum == one.correct_sum
    assert torch.equal(many.per_pos_correct, one.per_pos_correct)
    for a, b in zip(g_many, g_one):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_packed_anchors_give_the_padded_loss_and_gradients():
    drafter, head, batch, arch = toy_drafter_parts()
    packed = _loss(drafter, head, batch, max_rows=2 * B, backward=True)
    g_packed = _grads(drafter)
    # The old layout: an [N, A_max] anchor table padded with anchor 0, dense masked attention over
    # [N, A*B, S + A*B], and only the valid blocks' rows in the loss.
    ids, mask, lens = batch.host()
    seq, anchors = sample_blocks(mask, lens, B, 7, torch.Generator().manual_seed(3))
    N = ids.shape[0]
    A = max(np.bincount(seq, minlength=N))
    table = np.zeros((N, A), np.int64)
    valid = np.zeros((N, A), bool)
    for n in range(N):
        a = anchors[seq == n]
        table[n, :len(a)], valid[n, :len(a)] = a, True
    pad_seq, pad_anchor = np.repeat(np.arange(N), A), table.reshape(-1)
    labels, lmask = packed_labels(ids, mask, lens, pad_seq, pad_anchor, B)
    w = torch.from_numpy(lmask * np.exp(-np.arange(B - 1) / default_gamma(B)) * valid.reshape(-1, 1))
    block_ids = torch.full((N * A, B), arch.mask_token_id)
    block_ids[:, 0] = torch.from_numpy(ids[pad_seq, pad_anchor])
    drafter.zero_grad(set_to_none=True)
    hidden = drafter(head.embed(block_ids).view(N, A * B, -1), batch.hidden_BSD, torch.from_numpy(table),
                     batch.lengths_B, kernel="dense")
    rows = hidden.view(N * A, B, -1)[:, 1:].reshape(-1, hidden.shape[-1])
    nll = full_cross_entropy(rows, head.lm_head.weight, torch.from_numpy(labels).reshape(-1))
    padded = (nll * w.reshape(-1).float()).sum()
    padded.backward()
    assert packed.loss_sum.item() == pytest.approx(padded.item(), rel=1e-5)
    assert packed.weight_sum == pytest.approx(float(w.sum()), rel=1e-6)
    for a, b in zip(g_packed, _grads(drafter)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_bf16_run_saves_activations_in_bf16():
    drafter, head, batch, arch = toy_drafter_parts()  # fp32 master weights
    head = head.to(torch.bfloat16)
    batch.hidden_BSD = batch.hidden_BSD.to(torch.bfloat16)  # as the payload arrives on GPU
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = _loss(drafter, head, batch, max_rows=0, backward=False)
    rows = out.num_blocks * B
    params = {p.numel() for p in drafter.parameters()}
    acts = [s for s in saved if s[2] not in params and s[2] > 64]  # fp32 master weights are fixed state
    # fp32 only for per-row-and-head scalars (RMSNorm's rstd, attention's log-sum-exp): no width dim.
    widths = {arch.hidden_size, arch.head_dim, arch.intermediate_size, arch.feature_dim}
    wide32 = [s for s in acts if s[1] == torch.float32 and s[0][-1] in widths]
    assert not wide32, wide32
    bytes16 = sum(2 * s[2] for s in acts if s[1] == torch.bfloat16)
    bytes32 = sum(4 * s[2] for s in acts if s[1] == torch.float32)
    assert bytes16 > 10 * rows * arch.hidden_size and bytes32 < 0.1 * bytes16, (bytes16, bytes32)
    out.loss_sum.backward()
    assert all(p.grad.dtype == torch.float32 for p in drafter.parameters())


def test_weighted_ce_gradient_from_forward_equals_full_ce():
    torch.manual_seed(0)
    h = torch.randn(37, 16).requires_grad_()
    W = torch.randn(301, 16)
    y = torch.randint(0, 301, (37,))
    w = torch.rand(37)
    loss, nll, pred, top = weighted_chunked_ce(h, W, y, w, chunk_rows=5, topk=3)
    (2.5 * loss).backward()  # backward only scales the gradient computed in the forward
    g = h.grad.clone()
    h.grad = None
    ref = (full_cross_entropy(h, W, y) * w).sum()
    (2.5 * ref).backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g, h.grad, rtol=1e-5, atol=1e-5)
    assert torch.equal(pred, (h.detach() @ W.T).argmax(-1))


def test_rmsnorm_and_swiglu_gradients():
    torch.manual_seed(0)
    norm = RMSNorm(6, 1e-6).double()
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: norm(x), (x, norm.weight))
    mlp = MLP(6, 10).double()
    assert torch.autograd.gradcheck(mlp, (x,))
    y = norm(x.float().to(torch.bfloat16))
    assert y.dtype == torch.bfloat16  # never promoted to the fp64/fp32 weight's dtype


def test_payload_keeps_host_copies_and_cpu_staging_is_a_no_op():
    from app.messages import HiddenBatch
    from app.payload.staging import PayloadStager

    hb = HiddenBatch(job_id=1, hidden_BSD=np.zeros((2, 5, 8), np.float32), hidden_dtype="float32",
                     input_ids_BS=np.arange(10).reshape(2, 5), loss_mask_BS=np.ones((2, 5), np.uint8),
                     lengths_B=np.array([5, 4]))
    stager = PayloadStager(torch.device("cpu"), torch.float32)
    assert stager.stage(hb) is hb  # CPU: converted on the compute thread, as before
    tb = TrainBatch.from_hidden_batch(hb, "cpu", torch.float32)
    ids, mask, lens = tb.host()  # anchors and labels are sampled from these, not from the device
    assert ids.tolist() == hb.input_ids_BS.tolist() and mask.dtype == np.float32 and lens.tolist() == [5, 4]
    assert stager.ready(tb) is tb


def test_activation_checkpointing_gives_the_same_gradients():
    drafter, head, batch, _ = toy_drafter_parts()
    plain = _loss(drafter, head, batch, max_rows=5 * B, backward=True)
    g_plain = _grads(drafter)
    drafter.activation_checkpointing = True
    ckpt = _loss(drafter, head, batch, max_rows=5 * B, backward=True)
    assert ckpt.loss_sum.item() == pytest.approx(plain.loss_sum.item(), rel=1e-6)
    for a, b in zip(_grads(drafter), g_plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
