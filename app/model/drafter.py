"""The DFlash drafter module (z-lab `DFlashDraftModel` semantics and parameter names)."""
from __future__ import annotations

import torch
from torch import nn

from app.model.arch import DrafterArch
from app.model.layers import DecoderLayer, RMSNorm, rope_cos_sin
from app.model.mask import block_mask, block_positions, key_positions


class DFlashDrafter(nn.Module):
    """N Qwen3-style layers over a block of [anchor token, MASK x (B-1)] embeddings.

    The target features of the context (k layers concatenated) are fused once per forward by
    `fc` + `hidden_norm` and injected into every layer's keys/values. The output is the final-normed
    hidden state of every block position; logits come from the target's frozen `lm_head`.
    No embedding or LM head here: those are the target's (see `TargetHead`).
    """

    def __init__(self, arch: DrafterArch) -> None:
        super().__init__()
        self.arch = arch
        self.layers = nn.ModuleList([DecoderLayer(arch) for _ in range(arch.num_layers)])
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.fc = nn.Linear(arch.feature_dim, arch.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """HF-style init (normal(0, initializer_range) linears, unit norms), as z-lab's post_init."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=self.arch.initializer_range)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def fuse_context(self, context_feats_NSD: torch.Tensor) -> torch.Tensor:
        """fc (k*H -> H) then RMSNorm: the context every layer projects into its keys/values."""
        return self.hidden_norm(self.fc(context_feats_NSD))

    def forward(
        self,
        block_embeds_NQH: torch.Tensor,
        context_feats_NSD: torch.Tensor,
        anchors_NA: torch.Tensor,
        lengths_N: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [N, A*B, H] of every block position.

        `block_embeds_NQH`: target embeddings of the A blocks flattened (row j*B + i).
        `context_feats_NSD`: target features of positions 0..S-1 (padding past `lengths_N` unseen).
        `anchors_NA`: anchor positions p_j; block j sits at p_j + 0..B-1 and sees context < p_j.
        """
        N, Q, _ = block_embeds_NQH.shape
        A = anchors_NA.shape[1]
        assert Q % A == 0, f"block rows {Q} are not a multiple of {A} anchors"
        B, S = Q // A, context_feats_NSD.shape[1]
        dtype = block_embeds_NQH.dtype
        context_NSH = self.fuse_context(context_feats_NSD.to(self.fc.weight.dtype)).to(dtype)
        mask = block_mask(anchors_NA, S, B, lengths_N)
        d, theta = self.arch.head_dim, self.arch.rope_theta
        rope_q = rope_cos_sin(block_positions(anchors_NA, B), d, theta, dtype)
        rope_k = rope_cos_sin(key_positions(anchors_NA, S, B), d, theta, dtype)
        x = block_embeds_NQH
        for layer in self.layers:
            x = layer(x, context_NSH, rope_q, rope_k, mask)
        return self.norm(x)
