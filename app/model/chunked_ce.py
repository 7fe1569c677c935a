"""Cross-entropy through the LM head without materialising [rows, vocab] logits.

Two custom autograd functions, both computing logits chunk by chunk (ce_chunk_rows rows at a time):
- `weighted_chunked_ce` (training): the loss weights are known in the forward, so each chunk's
  hidden-state gradient `w * (softmax - onehot) @ W` is computed right there, while its logits are
  live, and kept in the hidden dtype (the same bytes the hidden rows would take); backward only
  scales it. The logits are computed once per step instead of twice.
- `chunked_cross_entropy` (per-row NLL, any downstream use): keeps the per-row log-sum-exp and
  recomputes each chunk's logits in backward.
Peak extra memory is one chunk of logits (plus its softmax). The head weight is frozen: no grad.
"""
from __future__ import annotations

import torch


def _nll_chunks(hidden_RH, weight_VH, labels_R, chunk_rows: int, topk: int):
    """(NLL [R] fp32, log-sum-exp [R] fp32, argmax [R], label-in-top-k [R]), the logits chunk by chunk: the
    forward of `chunked_cross_entropy` and, without a graph, `full_nll_argmax`."""
    R = hidden_RH.shape[0]
    nll = torch.empty(R, dtype=torch.float32, device=hidden_RH.device)
    lse = torch.empty_like(nll)
    pred = torch.empty(R, dtype=torch.long, device=hidden_RH.device)
    topk_hit = torch.zeros(R, dtype=torch.bool, device=hidden_RH.device)
    for lo in range(0, R, chunk_rows):
        hi = min(R, lo + chunk_rows)
        logits = (hidden_RH[lo:hi] @ weight_VH.T).float()
        lse[lo:hi] = torch.logsumexp(logits, dim=-1)
        tgt = logits.gather(1, labels_R[lo:hi, None])[:, 0]
        nll[lo:hi] = lse[lo:hi] - tgt
        pred[lo:hi] = logits.argmax(dim=-1)
        if topk > 0:
            top = logits.topk(min(topk, logits.shape[1]), dim=-1).indices
            topk_hit[lo:hi] = (top == labels_R[lo:hi, None]).any(dim=-1)
        del logits
    return nll, lse, pred, topk_hit


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_RH, weight_VH, labels_R, chunk_rows: int, topk: int):
        nll, lse, pred, topk_hit = _nll_chunks(hidden_RH, weight_VH, labels_R, chunk_rows, topk)
        ctx.save_for_backward(hidden_RH, weight_VH, labels_R, lse)
        ctx.chunk_rows = chunk_rows
        ctx.mark_non_differentiable(pred, topk_hit)
        return nll, pred, topk_hit

    @staticmethod
    def backward(ctx, grad_nll_R, _grad_pred, _grad_topk):
        hidden_RH, weight_VH, labels_R, lse = ctx.saved_tensors
        assert not ctx.needs_input_grad[1], "the LM head is frozen; chunked CE gives no weight grad"
        grad_hidden = torch.empty_like(hidden_RH)
        for lo in range(0, hidden_RH.shape[0], ctx.chunk_rows):
            hi = min(hidden_RH.shape[0], lo + ctx.chunk_rows)
            # d nll / d logits = softmax - onehot; recomputed here rather than stored.
            g = (hidden_RH[lo:hi] @ weight_VH.T).float()
            g.sub_(lse[lo:hi, None]).exp_()
            g[torch.arange(hi - lo, device=g.device), labels_R[lo:hi]] -= 1.0
            g.mul_(grad_nll_R[lo:hi, None].float())
            grad_hidden[lo:hi] = (g.to(weight_VH.dtype) @ weight_VH).to(hidden_RH.dtype)
            del g
        return grad_hidden, None, None, None, None


class _WeightedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_RH, weight_VH, labels_R, w_R, chunk_rows: int, topk: int, bias_V=None):
        R = hidden_RH.shape[0]
        dev = hidden_RH.device
        nll = torch.empty(R, dtype=torch.float32, device=dev)
        pred = torch.empty(R, dtype=torch.long, device=dev)
        topk_hit = torch.zeros(R, dtype=torch.bool, device=dev)
        grad_RH = torch.empty_like(hidden_RH)
        w32 = w_R.float()
        for lo in range(0, R, chunk_rows):
            hi = min(R, lo + chunk_rows)
            logits = (hidden_RH[lo:hi] @ weight_VH.T).float()
            if bias_V is not None:  # a sampled slice's log-correction (app/model/vocab_sample.py)
                logits += bias_V
            lse = torch.logsumexp(logits, dim=-1)
            nll[lo:hi] = lse - logits.gather(1, labels_R[lo:hi, None])[:, 0]
            pred[lo:hi] = logits.argmax(dim=-1)
            if topk > 0:
                top = logits.topk(min(topk, logits.shape[1]), dim=-1).indices
                topk_hit[lo:hi] = (top == labels_R[lo:hi, None]).any(dim=-1)
            # d(sum w * nll)/d logits = w * (softmax - onehot), in place over the logits.
            g = logits.sub_(lse[:, None]).exp_()
            g[torch.arange(hi - lo, device=dev), labels_R[lo:hi]] -= 1.0
            g.mul_(w32[lo:hi, None])
            grad_RH[lo:hi] = (g.to(weight_VH.dtype) @ weight_VH).to(hidden_RH.dtype)
            del logits, g
        ctx.save_for_backward(grad_RH)
        ctx.mark_non_differentiable(nll, pred, topk_hit)
        return (nll * w32).sum(), nll, pred, topk_hit

    @staticmethod
    def backward(ctx, grad_loss, _g_nll, _g_pred, _g_topk):
        (grad_RH,) = ctx.saved_tensors
        assert not ctx.needs_input_grad[1], "the LM head is frozen; weighted CE gives no weight grad"
        return grad_RH * grad_loss.to(grad_RH.dtype), None, None, None, None, None, None


def weighted_chunked_ce(hidden_RH: torch.Tensor, weight_VH: torch.Tensor, labels_R: torch.Tensor,
                        w_R: torch.Tensor, chunk_rows: int = 1024, topk: int = 0):
    """(sum of w * NLL, differentiable w.r.t. hidden; NLL [R]; argmax [R]; label-in-top-k [R]).

    The input gradient is computed in the forward (the weights are known), so backward never
    recomputes logits. Use it when the loss is exactly `sum(w * nll)`."""
    if chunk_rows < 1:
        raise ValueError(f"drafter.ce_chunk_rows={chunk_rows} must be >= 1")
    return _WeightedCE.apply(hidden_RH, weight_VH, labels_R, w_R, int(chunk_rows), int(topk))


def sampled_weighted_ce(hidden_RH: torch.Tensor, weight_VH: torch.Tensor, vslice, w_R: torch.Tensor,
                        chunk_rows: int = 1024):
    """`weighted_chunked_ce` over a `VocabSlice`'s columns (sampled softmax): (sum of w * NLL, NLL [R], argmax
    [R] as vocabulary ids, within the slice). The loss and its gradient are the slice's; see vocab_sample.py."""
    if chunk_rows < 1:
        raise ValueError(f"drafter.ce_chunk_rows={chunk_rows} must be >= 1")
    weight_CH = weight_VH.index_select(0, vslice.cols_C)
    loss, nll, pred, _ = _WeightedCE.apply(hidden_RH, weight_CH, vslice.local_labels_R, w_R, int(chunk_rows), 0,
                                           vslice.bias_C)
    return loss, nll, vslice.cols_C[pred]


@torch.no_grad()
def full_nll_argmax(hidden_RH: torch.Tensor, weight_VH: torch.Tensor, labels_R: torch.Tensor,
                    chunk_rows: int = 1024, topk: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The full vocabulary's NLL [R], argmax [R] and label-in-top-k [R], no gradient (the exact figures a
    sampled step is checked against)."""
    nll, _, pred, hit = _nll_chunks(hidden_RH, weight_VH, labels_R, chunk_rows, topk)
    return nll, pred, hit


def chunked_cross_entropy(
    hidden_RH: torch.Tensor,
    weight_VH: torch.Tensor,
    labels_R: torch.Tensor,
    chunk_rows: int = 1024,
    topk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row NLL [R] (fp32, differentiable w.r.t. hidden), argmax [R], label-in-top-k [R]."""
    if chunk_rows < 1:
        raise ValueError(f"drafter.ce_chunk_rows={chunk_rows} must be >= 1")
    return _ChunkedCE.apply(hidden_RH, weight_VH, labels_R, int(chunk_rows), int(topk))


def full_cross_entropy(hidden_RH, weight_VH, labels_R) -> torch.Tensor:
    """Reference: per-row NLL from the full logits (tests and the memory bench only)."""
    logits = (hidden_RH @ weight_VH.T).float()
    return torch.nn.functional.cross_entropy(logits, labels_R, reduction="none")
