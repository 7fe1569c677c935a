"""Qwen3-style building blocks of the drafter, named as in z-lab's `DFlashDraftModel`.

Attribute names (`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, ...) are the checkpoint's
parameter names, so a state_dict of these modules is a z-lab checkpoint as is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from app.model.arch import DrafterArch


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin for integer `positions` (any shape) -> shape + [head_dim], as Qwen3RotaryEmbedding."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x_NhLd: torch.Tensor, cos_NLd: torch.Tensor, sin_NLd: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [N, heads, L, d] by per-position cos/sin [N, L, d]."""
    cos, sin = cos_NLd[:, None], sin_NLd[:, None]
    return x_NhLd * cos + _rotate_half(x_NhLd) * sin


class MLP(nn.Module):
    """SwiGLU, no bias (Qwen3MLP)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values = [proj(context), proj(block)]; per-head q/k RMSNorm; RoPE.

    Not causal: which key a query sees is decided only by the boolean mask handed in.
    """

    def __init__(self, arch: DrafterArch) -> None:
        super().__init__()
        h, d, bias = arch.hidden_size, arch.head_dim, arch.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, d
        self.q_proj = nn.Linear(h, arch.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, arch.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, arch.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(arch.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, arch.rms_norm_eps)
        self.k_norm = RMSNorm(d, arch.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        N, L, _ = x.shape
        return x.view(N, L, n, self.head_dim)

    def forward(
        self,
        block_NQH: torch.Tensor,
        context_NSH: torch.Tensor,
        rope_q: tuple[torch.Tensor, torch.Tensor],
        rope_k: tuple[torch.Tensor, torch.Tensor],
        mask_NQK: torch.Tensor | None,
    ) -> torch.Tensor:
        N, Q, _ = block_NQH.shape
        q = self.q_norm(self._heads(self.q_proj(block_NQH), self.num_heads)).transpose(1, 2)
        k_in = torch.cat([self.k_proj(context_NSH), self.k_proj(block_NQH)], dim=1)
        v_in = torch.cat([self.v_proj(context_NSH), self.v_proj(block_NQH)], dim=1)
        k = self.k_norm(self._heads(k_in, self.num_kv_heads)).transpose(1, 2)
        v = self._heads(v_in, self.num_kv_heads).transpose(1, 2)
        q = apply_rope(q, *rope_q)
        k = apply_rope(k, *rope_k)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            # repeat_interleave matches HF's repeat_kv head order (kv head i serves q heads i*g..).
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        mask = None if mask_NQK is None else mask_NQK[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(N, Q, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU with residuals. The context is not normed per layer (as z-lab)."""

    def __init__(self, arch: DrafterArch) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(arch)
        self.mlp = MLP(arch.hidden_size, arch.intermediate_size)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x_NQH, context_NSH, rope_q, rope_k, mask_NQK) -> torch.Tensor:
        x_NQH = x_NQH + self.self_attn(self.input_layernorm(x_NQH), context_NSH, rope_q, rope_k, mask_NQK)
        return x_NQH + self.mlp(self.post_attention_layernorm(x_NQH))
