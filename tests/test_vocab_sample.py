"""Sampled softmax of the drafter's loss (app/model/vocab_sample.py): exact when the slice is the vocabulary,
an unbiased normaliser otherwise, the labels and the mask token always in, and the full figures on check steps."""
from __future__ import annotations

import math

import numpy as np
import torch

from app.model.chunked_ce import full_nll_argmax, sampled_weighted_ce, weighted_chunked_ce
from app.model.vocab_sample import sample_columns, vocab_slice


def _rows(R=24, H=16, V=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(R, H, generator=g, dtype=torch.float64, requires_grad=True),
            torch.randn(V, H, generator=g, dtype=torch.float64), torch.randint(0, V, (R,), generator=g),
            torch.rand(R, generator=g, dtype=torch.float64))


def test_columns_hold_labels_and_always_ids_uncorrected_and_negatives_corrected():
    labels = np.array([5, 7, 7, 9])
    cols, bias = sample_columns(labels, (3,), 100, 10, torch.Generator().manual_seed(0))
    assert list(cols[:4]) == [3, 5, 7, 9] and (bias[:4] == 0).all()
    assert len(cols) == 14 and len(set(cols.tolist())) == 14
    assert np.allclose(bias[4:], math.log(96 / 10))  # 96 ids left, 10 drawn


def test_slice_of_the_whole_vocabulary_is_the_full_loss_and_gradient():
    h, W, y, w = _rows()
    vs = vocab_slice(y.numpy(), (), W.shape[0], 10_000, torch.Generator().manual_seed(0), "cpu")
    assert len(vs.cols_C) == W.shape[0] and float(vs.bias_C.abs().sum()) == 0.0
    loss_s, nll_s, pred_s = sampled_weighted_ce(h, W, vs, w, chunk_rows=7)
    (g_s,) = torch.autograd.grad(loss_s, h)
    loss_f, nll_f, pred_f, _ = weighted_chunked_ce(h, W, y, w, chunk_rows=5)
    (g_f,) = torch.autograd.grad(loss_f, h)
    assert torch.allclose(loss_s, loss_f) and torch.allclose(g_s, g_f, atol=1e-5) and torch.equal(pred_s, pred_f)


def test_sampled_normaliser_is_unbiased_over_draws():
    """The mean over draws of sum(exp(logit + bias)) over the slice equals the full vocabulary's sum."""
    h, W, y, _ = _rows(R=1, V=300)
    logits = (h.detach() @ W.T)[0]
    full = float(logits.exp().sum())
    est = []
    for seed in range(3000):
        vs = vocab_slice(y.numpy(), (0,), 300, 30, torch.Generator().manual_seed(seed), "cpu")
        est.append(float((logits[vs.cols_C] + vs.bias_C.double()).exp().sum()))
    assert abs(np.mean(est) / full - 1) < 0.03, (np.mean(est), full)
    assert np.std(est) > 0  # it is an estimate: the draws differ


def test_full_check_gives_the_exact_loss_of_the_same_rows():
    h, W, y, w = _rows()
    nll, pred, hit = full_nll_argmax(h, W, y, chunk_rows=4, topk=5)
    ref = torch.nn.functional.cross_entropy(h.detach() @ W.T, y, reduction="none")
    assert torch.allclose(nll.double(), ref, atol=1e-5)
    assert torch.equal(pred, (h.detach() @ W.T).argmax(-1)) and hit.dtype == torch.bool
