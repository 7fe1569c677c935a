"""Anchors, labels, weights, chunked CE and the overfit check of the DFlash loss."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from app.messages import HiddenBatch
from app.model.chunked_ce import chunked_cross_entropy, full_cross_entropy
from app.model.drafter import DFlashDrafter
from app.config.drafter_sections import DrafterConfig
from app.model.loss import TrainBatch, block_labels, decay_weights, dflash_loss, sample_anchors
from app.model.target_head import TargetHead
from tests.toy import tiny_arch, tiny_qwen3_config



def _batch(N=2, S=24, H=32, k=2, V=128, seed=0, lengths=(24, 17)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (N, S), generator=g)
    lengths_t = torch.tensor(lengths)
    mask = (torch.arange(S)[None] < lengths_t[:, None]).float()
    mask[:, :3] = 0  # a "prompt" that is not trained on
    return TrainBatch(ids, mask, torch.randn(N, S, k * H, generator=g), lengths_t)


def _head(V=128, H=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TargetHead(torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.3)


def test_sample_anchors_respects_mask_and_keeps_one_label_inside_the_sequence():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1])
    g = torch.Generator().manual_seed(0)
    a = sample_anchors(mask, 10, 4, 100, g)
    assert a.tolist() == [2, 3, 4, 6, 7, 8]  # loss_mask 1 and p + 1 < 10: the block's first label is real
    a = sample_anchors(mask, 10, 4, 2, g)
    assert len(a) == 2 and len(set(a.tolist())) == 2 and set(a.tolist()) <= {2, 3, 4, 6, 7, 8}
    assert sample_anchors(mask, 3, 4, 8, g).numel() == 0  # position 2's next token is past the length
    assert sample_anchors(mask, 4, 4, 8, g).tolist() == [2]  # one label (3) inside, the block's rest masked
    assert sample_anchors(torch.tensor([1, 1]), 1, 4, 8, g).numel() == 0  # no label after the only token


def test_labels_are_same_position_not_shifted():
    b = _batch()
    anchors = torch.tensor([[3, 10], [5, 13]])
    labels, lmask = block_labels(b, anchors, 4)
    for n in range(2):
        for j in range(2):
            for k in range(1, 4):
                assert labels[n, j, k - 1] == b.input_ids_BS[n, anchors[n, j] + k]
    assert lmask[1, 1].tolist() == [1.0, 1.0, 1.0]  # 13 + 3 = 16 < 17


class _OracleDrafter(nn.Module):
    """Outputs one-hot(input_ids[p_j + i]) at block row i: right only under same-position labels."""

    def __init__(self, arch, ids):
        super().__init__()
        self.arch, self.ids = arch, ids
        self.w = nn.Parameter(torch.ones(()))

    def forward_packed(self, embeds_RH, feats_TD, sub):
        B = self.arch.block_size
        seq_R = torch.from_numpy(sub.seq_M).repeat_interleave(B)
        pos_R = sub.q_pos_R.clamp(max=self.ids.shape[1] - 1)
        return nn.functional.one_hot(self.ids[seq_R, pos_R], 32).float() * self.w


def test_loss_trains_same_position_labels_and_weights():
    V = H = 32
    b = _batch(V=V)
    arch = tiny_arch(tiny_qwen3_config(vocab=V), block_size=4, target_layer_ids=(0, 2))
    head = TargetHead(torch.randn(V, H), torch.eye(V) * 10)
    out = dflash_loss(_OracleDrafter(arch, b.input_ids_BS), head, b, block_size=4, num_anchors=64,
                      gamma=2.0, generator=torch.Generator().manual_seed(0))
    assert out.weight_sum > 0 and out.correct_sum == pytest.approx(out.weight_sum, rel=1e-6)
    # Anchors: positions 3..22 (S=24) and 3..15 (len 17): one label inside the sequence -> 20 + 13 blocks; a
    # label past the length is masked, so position k counts the blocks with p + k < len.
    assert out.num_blocks == 33
    assert out.per_pos_count.tolist() == [33.0, 31.0, 29.0]
    assert math.isclose(out.weight_sum, 33 + 31 * math.exp(-1 / 2) + 29 * math.exp(-2 / 2), rel_tol=1e-6)
    assert out.accept_len_sum == 33 + 33 + 31 + 29  # every labelled position accepted, then the bonus


def test_decay_weights_and_the_gamma_a_run_trains_with():
    assert decay_weights(4, 2.0).tolist() == pytest.approx([1.0, math.exp(-1 / 2), math.exp(-1)])
    assert decay_weights(16, 7.0).dtype == np.float32 and len(decay_weights(16, 7.0)) == 15
    # DrafterConfig.gamma: loss_gamma, or for 0 DFlash's default for the block (7 for 16, 4 for 8)
    assert (DrafterConfig().gamma, DrafterConfig(block_size=8).gamma, DrafterConfig(loss_gamma=2.5).gamma) == (7.0, 4.0, 2.5)


def test_loss_without_gamma_uses_the_block_default():
    V = 32
    b = _batch(V=V)
    arch = tiny_arch(tiny_qwen3_config(vocab=V), block_size=4, target_layer_ids=(0, 2))
    head = TargetHead(torch.randn(V, 32), torch.eye(V) * 10)

    def weight_sum(**kw) -> float:
        return dflash_loss(_OracleDrafter(arch, b.input_ids_BS), head, b, block_size=4, num_anchors=64,
                           generator=torch.Generator().manual_seed(0), **kw).weight_sum

    default = DrafterConfig(block_size=4).gamma  # 7 * 4 / 16 = 1.75
    assert default == 1.75
    expected = 33 + 31 * math.exp(-1 / 1.75) + 29 * math.exp(-2 / 1.75)  # 33 blocks; labels past the length masked
    assert weight_sum() == pytest.approx(expected, rel=1e-6) and weight_sum(gamma=default) == pytest.approx(expected, rel=1e-6)


def test_chunked_ce_matches_full_in_fp32():
    torch.manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64).float().requires_grad_()
    W = torch.randn(301, 16)
    y = torch.randint(0, 301, (37,))
    w = torch.rand(37)
    nll, pred, top = chunked_cross_entropy(h, W, y, chunk_rows=5, topk=3)
    (nll * w).sum().backward()
    g_chunk = h.grad.clone()
    h.grad = None
    ref = full_cross_entropy(h, W, y)
    (ref * w).sum().backward()
    torch.testing.assert_close(nll, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(g_chunk, h.grad, rtol=0, atol=1e-5)
    logits = h.detach() @ W.T
    assert torch.equal(pred, logits.argmax(-1))
    assert torch.equal(top, (logits.topk(3).indices == y[:, None]).any(-1))


def test_gradients_reach_only_drafter_parameters():
    arch = tiny_arch(tiny_qwen3_config(), block_size=4, target_layer_ids=(0, 2))
    drafter, head, b = DFlashDrafter(arch), _head(), _batch()
    out = dflash_loss(drafter, head, b, block_size=4, num_anchors=8, generator=torch.Generator().manual_seed(0))
    out.loss_sum.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    assert all(not p.requires_grad and p.grad is None for p in head.parameters())
    assert not b.hidden_BSD.requires_grad


def test_loss_falls_90_percent_when_overfitting_one_batch():
    torch.manual_seed(0)
    arch = tiny_arch(tiny_qwen3_config(), block_size=4, target_layer_ids=(0, 2))
    drafter, head, b = DFlashDrafter(arch), _head(), _batch(N=1, lengths=(24,))
    opt = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        out = dflash_loss(drafter, head, b, block_size=4, num_anchors=6, ce_chunk_rows=7,
                          generator=torch.Generator().manual_seed(0))  # the same anchors every step
        loss = out.loss_sum / out.weight_sum
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] <= 0.1 * losses[0], (losses[0], losses[-1])


def test_empty_batch_gives_differentiable_zero():
    arch = tiny_arch(tiny_qwen3_config(), block_size=4, target_layer_ids=(0, 2))
    drafter, b = DFlashDrafter(arch), _batch(lengths=(3, 2))
    out = dflash_loss(drafter, _head(), b, block_size=4, num_anchors=8)
    out.loss_sum.backward()
    assert out.weight_sum == 0 and out.num_blocks == 0
    assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in drafter.parameters())


def test_from_hidden_batch_reads_bf16_uint16_view():
    h = torch.randn(2, 5, 8).to(torch.bfloat16)
    a = h.view(torch.int16).numpy().view(np.uint16)
    a.setflags(write=False)
    hb = HiddenBatch(job_id=1, hidden_BSD=a, hidden_dtype="bfloat16", input_ids_BS=np.zeros((2, 5), np.int64),
                     loss_mask_BS=np.ones((2, 5), np.uint8), lengths_B=np.array([5, 4]))
    tb = TrainBatch.from_hidden_batch(hb, "cpu", torch.float32)
    assert torch.equal(tb.hidden_BSD, h.float())
    tb16 = TrainBatch.from_hidden_batch(hb, "cpu", torch.bfloat16)
    assert torch.equal(tb16.hidden_BSD, h)
    tb16.hidden_BSD.add_(1)  # a private copy: writable
    assert tb.loss_mask_BS.dtype == torch.float32 and tb.lengths_B.tolist() == [5, 4]
