"""Qwen3-style building blocks of the drafter, named as in z-lab's `DFlashDraftModel`.

Attribute names (`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, ...) are the checkpoint's
parameter names, so a state_dict of these modules is a z-lab checkpoint as is.

Activation discipline: every module returns its input's dtype. With fp32 master weights under bf16
autocast, a plain `weight * x` would promote the residual stream and everything after it to fp32
(twice the saved-for-backward bytes); RMSNorm and SwiGLU are therefore small autograd Functions
that do their math in fp32 internally, save only compute-dtype tensors (plus one fp32 scalar per
row), and recompute the rest in backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from app.model import attention as _attention
from app.model.arch import DrafterArch


def _wide(t: torch.Tensor) -> torch.Tensor:
    """At least fp32 for the math (fp64 stays fp64, so gradcheck sees exact gradients)."""
    return t if t.dtype == torch.float64 else t.float()


class _RMSNormFn(torch.autograd.Function):
    """y = w * (x / rms(x)), fp32 inside; saves x (its own dtype) and rstd [..., 1] fp32."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        x32 = _wide(x)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        # Round the normalised value to x's dtype before the scale, as Qwen3RMSNorm does.
        y = _wide((x32 * rstd).to(x.dtype)) * _wide(weight)
        ctx.save_for_backward(x, weight, rstd)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        x32, g32, w32 = _wide(x), _wide(g), _wide(weight)
        xhat = x32 * rstd
        gw = g32 * w32
        # d/dx of x*rstd: rstd * (gw - xhat * mean(gw * xhat))
        gx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        gweight = (g32 * _wide(xhat.to(x.dtype))).reshape(-1, x.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return gx.to(x.dtype), None if gweight is None else gweight.to(weight.dtype), None


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: normalise in fp32, return the input dtype (never promote to the weight's)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin for integer `positions` (any shape) -> shape + [head_dim], as Qwen3RotaryEmbedding."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x_hLd: torch.Tensor, cos_Ld: torch.Tensor, sin_Ld: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [..., heads, L, d] by per-position cos/sin [..., L, d] (broadcast over heads)."""
    cos, sin = cos_Ld.unsqueeze(-3), sin_Ld.unsqueeze(-3)
    return x_hLd * cos + _rotate_half(x_hLd) * sin


class _SwiGLUFn(torch.autograd.Function):
    """silu(gate) * up; saves gate and up only (silu recomputed in backward)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        g32, gate32 = _wide(g), _wide(gate)
        sig = torch.sigmoid(gate32)
        silu = gate32 * sig
        d_gate = g32 * _wide(up) * sig * (1 + gate32 * (1 - sig))
        return d_gate.to(gate.dtype), (g32 * silu).to(up.dtype)


class MLP(nn.Module):
    """SwiGLU, no bias (Qwen3MLP)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_SwiGLUFn.apply(self.gate_proj(x), self.up_proj(x)))


class DFlashAttention(nn.Module):
    """Queries from the blocks; keys/values = [proj(context), proj(blocks)]; per-head q/k RMSNorm; RoPE.

    Works on a packed sub-batch: `block_RH` holds every block's rows flat, `context_TH` the packed
    context tokens of the sequences involved; which key a query sees is decided by the `BlockPlan`
    (see `app/model/attention.py`), built once per sub-batch and shared by every layer.
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

    def forward(self, block_RH: torch.Tensor, context_TH: torch.Tensor, rope_q, rope_k, plan) -> torch.Tensor:
        R, T = block_RH.shape[0], context_TH.shape[0]
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        q_hRd = self.q_norm(self.q_proj(block_RH).view(R, hq, d)).transpose(0, 1)
        k_in = torch.cat([self.k_proj(context_TH), self.k_proj(block_RH)], dim=0)
        v_in = torch.cat([self.v_proj(context_TH), self.v_proj(block_RH)], dim=0)
        k_hKd = self.k_norm(k_in.view(T + R, hk, d)).transpose(0, 1)
        v_hKd = v_in.view(T + R, hk, d).transpose(0, 1)
        q_hRd = apply_rope(q_hRd, *rope_q)
        k_hKd = apply_rope(k_hKd, *rope_k)
        out_hRd = _attend(q_hRd, k_hKd, v_hKd, plan, d**-0.5)
        return self.o_proj(out_hRd.transpose(0, 1).reshape(R, hq * d))


@torch.compiler.disable
def _attend(q_hRd, k_hKd, v_hKd, plan, scale: float) -> torch.Tensor:
    # Outside a compiled layer's graph (`train.compile`): the plan's shapes and masks change every
    # sub-batch and would trigger a recompile each time; flex compiles itself once per process.
    return _attention.block_attention(q_hRd, k_hKd, v_hKd, plan, scale=scale)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU with residuals. The context is not normed per layer (as z-lab)."""

    def __init__(self, arch: DrafterArch) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(arch)
        self.mlp = MLP(arch.hidden_size, arch.intermediate_size)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x_RH, context_TH, rope_q, rope_k, plan) -> torch.Tensor:
        x_RH = x_RH + self.self_attn(self.input_layernorm(x_RH), context_TH, rope_q, rope_k, plan)
        return x_RH + self.mlp(self.post_attention_layernorm(x_RH))
