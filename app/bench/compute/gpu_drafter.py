"""The drafter half of `python -m app.bench gpu` (app/bench/compute/gpu.py): the needed training FLOPs of one
micro-batch, and the drafter step's tokens/s and MFU, timed through the step loop the actor runs
(app/bench/compute/alone.py) on the target's own batches.
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import torch


def drafter_train_flops(arch, hb, num_anchors: int) -> float:
    """Needed training FLOPs of one micro-batch: 3x (fc + drafter layers) + 2x the frozen LM head rows."""
    H, B = arch.hidden_size, arch.block_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    fwd = 0.0
    head = 0.0
    for row, n in enumerate(hb.lengths_B.tolist()):
        valid = np.flatnonzero(hb.loss_mask_BS[row, : max(0, n - B + 1)])
        A = min(num_anchors, len(valid))
        if A == 0:
            continue
        rows = A * B
        mean_anchor = float(valid.mean())  # anchors are a uniform sample of the valid positions
        per_layer = (2 * (H * q + q * H) * rows + 2 * 2 * H * kv * (rows + n) + 3 * 2 * H * arch.intermediate_size * rows
                     + 2 * 2 * q * rows * (mean_anchor + B))
        fwd += 2 * arch.feature_dim * H * n + arch.num_layers * per_layer
        head += 2 * H * arch.vocab_size * A * (B - 1)
    return 3 * fwd + 2 * head


def bench_drafter(s, model, batches) -> dict:
    """Tokens/s and MFU of the drafter's training step on `batches` (HiddenBatch), `s` being bench gpu's Setup."""
    from app.bench.compute.alone import step_alone
    from app.model.arch import DrafterArch
    from app.model.drafter import DFlashDrafter
    from app.model.target_head import TargetHead
    from app.training.trainer import DrafterTrainer

    dcfg = replace(s.dcfg, mask_token_id=s.mask_token_id)
    arch = DrafterArch.from_target(model.config, dcfg, s.layer_ids)
    torch.manual_seed(0)
    drafter = DFlashDrafter(arch).to(s.device, torch.float32)  # fp32 master weights, as the actor
    head = TargetHead(model.model.embed_tokens.weight, model.lm_head.weight)  # shared, not copied
    autocast = s.dtype if s.dtype != torch.float32 else None
    trainer = DrafterTrainer(drafter, head, dcfg, s.tcfg, total_steps=1000, device=s.device, autocast=autocast)
    order = [batches[i % len(batches)] for i in range(2 + s.drafter_jobs)]
    # Through the step loop the actor drives: train.grad_accum micro-batches a step (a group of one).
    pairs = [(i, hb) for i, hb in enumerate(order)]  # each its own job id: a repeated batch is a new job
    t_compile = time.perf_counter()
    step_alone(trainer, pairs[:2], 1, s.device, s.dtype)  # warm-up: compiles on CUDA (dynamic shapes: once)
    sync_device(s.device)
    warm_s = time.perf_counter() - t_compile
    flops = sum(drafter_train_flops(arch, hb, dcfg.num_anchors) for hb in order[2:])
    t0 = time.perf_counter()
    tokens = step_alone(trainer, pairs[2:], s.tcfg.grad_accum, s.device, s.dtype)
    sync_device(s.device)
    dt = time.perf_counter() - t0
    return {"tok_s": tokens / dt, "mfu": flops / dt / s.peak_flops, "warm_s": warm_s, "step_s": dt / len(order[2:])}


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so a timer read after it covers it; nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
