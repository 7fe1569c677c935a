"""The DFlash drafter module (z-lab `DFlashDraftModel` semantics and parameter names)."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from app.model.arch import DrafterArch
from app.model.layers import DecoderLayer, RMSNorm, rope_cos_sin


class DFlashDrafter(nn.Module):
    """N Qwen3-style layers over blocks of [anchor token, MASK x (B-1)] embeddings.

    The target features of the context (k layers concatenated) are fused once per forward by
    `fc` + `hidden_norm` and injected into every layer's keys/values. The output is the final-normed
    hidden state of every block position; logits come from the target's frozen `lm_head`.
    No embedding or LM head here: those are the target's (see `TargetHead`).

    `forward_packed` is the training path (flat blocks, packed context, block-sparse attention);
    `forward` keeps the batched [N, A*B] interface (speculative decoding, tests) and packs for it.
    `activation_checkpointing` recomputes each layer in backward instead of keeping its activations.
    `zero_features` is an ablation: the target features are replaced by zeros wherever the drafter reads
    them (training and drafting alike), so the drafter sees only its block's tokens; what it then
    reaches is what the features do not buy (`python -m app.bench quality --target smol`).
    """

    def __init__(self, arch: DrafterArch) -> None:
        super().__init__()
        self.arch = arch
        self.layers = nn.ModuleList([DecoderLayer(arch) for _ in range(arch.num_layers)])
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.fc = nn.Linear(arch.feature_dim, arch.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.activation_checkpointing = False
        self.zero_features = False
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

    def fuse_context(self, context_feats_TD: torch.Tensor) -> torch.Tensor:
        """fc (k*H -> H) then RMSNorm: the context every layer projects into its keys/values.

        Takes the features in whatever dtype they arrive (bf16 on GPU): no fp32 copy of the context;
        under autocast the matmul runs in the compute dtype against the fp32 master weight."""
        if self.zero_features:
            context_feats_TD = torch.zeros_like(context_feats_TD)
        return self.hidden_norm(self.fc(context_feats_TD))

    def forward_packed(self, block_embeds_RH: torch.Tensor, context_feats_TD: torch.Tensor, sub) -> torch.Tensor:
        """Hidden states [R, H] of the packed block rows (R = M*B, block j = rows j*B..j*B+B-1).

        `context_feats_TD`: target features of the sub-batch's packed context tokens; `sub`: its
        `app.model.packing.PackedSubBatch` (RoPE positions and the attention plan, built once per
        sub-batch and shared by every layer).
        """
        dtype = block_embeds_RH.dtype
        context_TH = self.fuse_context(context_feats_TD)
        d, theta, plan = self.arch.head_dim, self.arch.rope_theta, sub.plan
        rope_q = rope_cos_sin(sub.q_pos_R, d, theta, dtype)
        rope_k = rope_cos_sin(sub.k_pos_K, d, theta, dtype)
        x = block_embeds_RH
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                from torch.utils.checkpoint import checkpoint

                x = checkpoint(layer, x, context_TH, rope_q, rope_k, plan, use_reentrant=False)
            else:
                x = layer(x, context_TH, rope_q, rope_k, plan)
        return self.norm(x)

    def forward(
        self,
        block_embeds_NQH: torch.Tensor,
        context_feats_NSD: torch.Tensor,
        anchors_NA: torch.Tensor,
        lengths_N: torch.Tensor | None = None,
        kernel: str = "auto",
    ) -> torch.Tensor:
        """Hidden states [N, A*B, H] of every block position (every anchor real, none padded).

        `block_embeds_NQH`: target embeddings of the A blocks flattened (row j*B + i).
        `context_feats_NSD`: target features of positions 0..S-1 (padding past `lengths_N` unseen).
        `anchors_NA`: anchor positions p_j; block j sits at p_j + 0..B-1 and sees context < p_j.
        """
        from app.model.packing import pack_blocks

        N, Q, H = block_embeds_NQH.shape
        A = anchors_NA.shape[1]
        assert Q % A == 0, f"block rows {Q} are not a multiple of {A} anchors"
        B, S = Q // A, context_feats_NSD.shape[1]
        lengths = np.full(N, S) if lengths_N is None else lengths_N.cpu().numpy()
        seq_M = np.repeat(np.arange(N), A)
        anchors_M = anchors_NA.cpu().numpy().reshape(-1)
        sub = pack_blocks(seq_M, anchors_M, lengths, S, B, context_feats_NSD.device, kernel)
        ctx = context_feats_NSD.reshape(N * S, -1)[sub.ctx_index_T]
        out = self.forward_packed(block_embeds_NQH.reshape(N * Q, H), ctx, sub)
        return out.view(N, Q, H)
