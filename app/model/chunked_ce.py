"""Cross-entropy through the LM head without materialising [rows, vocab] logits.

A custom autograd function: the forward computes logits chunk by chunk (ce_chunk_rows rows at a
time) and keeps only the per-row log-sum-exp; the backward recomputes each chunk's logits and
turns them into the hidden-state gradient right away. Peak extra memory is one chunk of logits
(plus its softmax) instead of all rows, in both passes. The head weight is frozen: no grad for it.
"""
from __future__ import annotations

import torch


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_RH, weight_VH, labels_R, chunk_rows: int, topk: int):
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
