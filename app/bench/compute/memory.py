"""`python -m app.bench memory [--config conf/default.yaml] [--buckets 0,5]`

The drafter's predicted peak GPU memory per bucket of a config, for the path as built and for the
path before issue 17 (`--legacy-commit`, default d1f587d: whole job in one pass, padded anchors,
dense masked SDPA, fp32 norm promotion, CE recomputing logits in backward).

How: the job mix is `app/bench/compute/drafter_jobs.py` (stated there). The drafter is built at FULL width
(Qwen3-8B-shaped, 1.05B trainable) under `FakeTensorMode` -- no memory, no compute -- and one
forward of the largest sub-batch runs under bf16 autocast with `saved_tensors_hooks` counting every
tensor kept for backward (unique storages, so views count once). On CUDA the attention is flex,
whose backward keeps q, k, v, out and the fp32 log-sum-exp; a stand-in with exactly those saved
tensors replaces it here (flex cannot run on fake CPU tensors). The old path is the old code, read
from git at `--legacy-commit`, counted the same way (its dense SDPA saves the [Q, K] bias per layer).

peak = max(fixed + saved + backward working set + CE chunk workspace, fixed + step transient)
       + staged payloads, where
  fixed = fp32 weights + fp32 grads + AdamW (2 x fp32) + frozen embedding and LM head (bf16),
  backward working set = one layer's saved bytes (gradients of the layer being backpropagated),
  CE workspace = one chunk of logits: bf16 matmul out + fp32 logits + bf16 grad (rows x vocab),
  step transient = measured on the trainer's own `finish_step` (app/bench/compute/step_peak.py: a small
    drafter's step under a dispatch mode that follows every live storage), per parameter, times the full
    drafter's parameters: the fp32 all-reduce buffer beside the gradients while they are flattened (then
    freed; the buffer, scaled in place, becomes the gradients), 4 bytes per parameter; AdamW adds nothing
    fused (the trainer's CUDA path) and its sqrt temporary, 4 more, foreach (printed beside),
  staged payloads = two jobs' device payloads (the one being trained and the one staged next; bf16
    features, int64 ids, fp32 loss mask, padded as the target sends them), of the largest bucket.
saved_bytes_per_row = (saved bytes of the sub-batch - those of a one-block run) / query rows,
the worst bucket. rank_cost_spread is `app.bench.feeding.pull_policies.rank_cost_spread`: the pool's
dealing of the bucket mix to the ranks, on the discrete-event simulation.
Ends `RESULT max_peak_gib=... saved_bytes_per_row=... legacy_saved_bytes_per_row=... ratio=...
rank_cost_spread=... ce_recompute=0|1 step_extra_gib=... step_peak_gib=... adamw_foreach_gib=...
staged_payload_gib=...` (step_peak_gib: fixed + step transient + staged payloads, the peak at the step).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from app.bench.common import ROOT, SHAPES_ONLY, print_result

GIB = 2**30
LEGACY_COMMIT = "d1f587d"
LEGACY_FILES = ("layers", "mask", "drafter", "chunked_ce")


class _FlexStandIn(torch.autograd.Function):
    """Saves what flex_attention's backward keeps: q, k, v, out, and lse [heads, R] in fp32."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, g):  # never run: the bench counts the forward only
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


@contextlib.contextmanager
def _count_saved():
    """Collects (storage key, bytes, n_layers_tag) of every tensor saved for backward."""
    storages: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        storages[id(st)] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield storages


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _saved_new(arch, job, blocks: slice, chunk_rows: int) -> tuple[int, int]:
    """(saved bytes, of which the heaviest layer) for one sub-batch of the path as built."""
    from app.model import attention
    from app.model.chunked_ce import weighted_chunked_ce
    from app.model.drafter import DFlashDrafter
    from app.model.packing import pack_blocks

    B = arch.block_size
    S = int(job.lengths.max())
    sub = pack_blocks(job.seq_M[blocks], job.anchors_M[blocks], job.lengths, S, B, torch.device("cpu"), "none")
    orig = attention.block_attention
    attention.block_attention = lambda q, k, v, plan, scale: _FlexStandIn.apply(q, k, v)
    per_layer = []
    try:
        with _fake_mode():
            d = DFlashDrafter(arch)
            head_W = torch.empty(arch.vocab_size, arch.hidden_size, dtype=torch.bfloat16)
            R, T = sub.num_rows, sub.plan.num_ctx
            emb = torch.empty(R, arch.hidden_size, dtype=torch.bfloat16)
            feats = torch.empty(T, arch.feature_dim, dtype=torch.bfloat16)
            with _count_saved() as st, torch.autocast("cpu", dtype=torch.bfloat16):
                for layer in d.layers:  # per-layer bytes for the backward working set
                    layer.register_forward_hook(lambda m, i, o: per_layer.append(sum(st.values())))
                h = d.forward_packed(emb, feats, sub)
                rows = h.view(-1, B, arch.hidden_size)[:, 1:].reshape(-1, arch.hidden_size)
                n = rows.shape[0]
                weighted_chunked_ce(rows, head_W, torch.zeros(n, dtype=torch.long), torch.ones(n), chunk_rows, 0)
                total = sum(st.values())
    finally:
        attention.block_attention = orig
    layer_bytes = max(b - a for a, b in zip([per_layer[0]] + per_layer, per_layer)) if per_layer else 0
    return total, layer_bytes


def _legacy_modules(commit: str):
    """The old drafter code, read from git into a temporary package `legacy_model`."""
    tmp = Path(tempfile.mkdtemp(prefix="legacy_model_"))
    pkg = tmp / "legacy_model"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in LEGACY_FILES:
        src = subprocess.run(["git", "show", f"{commit}:app/model/{name}.py"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
        for other in LEGACY_FILES:
            src = src.replace(f"app.model.{other} ", f"legacy_model.{other} ")
        (pkg / f"{name}.py").write_text(src)
    sys.path.insert(0, str(tmp))
    return importlib.import_module("legacy_model.drafter"), importlib.import_module("legacy_model.chunked_ce")


def _saved_legacy(arch, job, chunk_rows: int, mods) -> int:
    """Saved bytes of the old path: the whole job, padded anchors, dense masked SDPA."""
    drafter_mod, ce_mod = mods
    B, N = arch.block_size, len(job.lengths)
    A, S = job.max_anchors(), int(job.lengths.max())
    with _fake_mode():
        d = drafter_mod.DFlashDrafter(arch)
        head_W = torch.empty(arch.vocab_size, arch.hidden_size, dtype=torch.bfloat16)
        emb = torch.empty(N, A * B, arch.hidden_size, dtype=torch.bfloat16)
        feats = torch.empty(N, S, arch.feature_dim, dtype=torch.bfloat16)
        anchors = torch.zeros(N, A, dtype=torch.long)
        with _count_saved() as st, torch.autocast("cpu", dtype=torch.bfloat16):
            # The old loss cast the embeddings to the fp32 parameter dtype before the drafter.
            h = d(emb.to(torch.float32), feats, anchors, torch.full((N,), S))
            rows = h.view(N, A, B, -1)[:, :, 1:].reshape(-1, arch.hidden_size)[: job.rows // B * (B - 1)]
            rows = rows.to(torch.bfloat16)
            ce_mod.chunked_cross_entropy(rows, head_W, torch.zeros(rows.shape[0], dtype=torch.long), chunk_rows, 0)
            return sum(st.values())


def _one_block_job(job):
    from app.bench.compute.drafter_jobs import BenchJob

    return BenchJob(job.bucket, job.block_size, job.lengths[:1], job.seq_M[:1] * 0, job.anchors_M[:1])


def fixed_bytes(arch) -> tuple[int, int]:
    """(training state, extra at the optimizer step): fp32 weights+grads+AdamW, bf16 embed+head; the step
    adds one fp32 per parameter (flat buffer beside the grads, then AdamW's sqrt beside the flat grads)."""
    from app.model.drafter import DFlashDrafter

    with _fake_mode():
        P = sum(p.numel() for p in DFlashDrafter(arch).parameters())
    head = 2 * arch.vocab_size * arch.hidden_size * 2
    return P * 16 + head, P * 4


def payload_bytes(arch, job) -> int:
    """Device bytes of one job's staged TrainBatch: [N, S] padded, bf16 features, int64 ids, fp32 mask."""
    N, S = len(job.lengths), int(job.lengths.max())
    return N * S * (arch.feature_dim * 2 + 8 + 4) + N * 8


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.bench memory", description=__doc__.splitlines()[2])
    p.add_argument("--config", default=str(ROOT / "conf/default.yaml"))
    p.add_argument("--buckets", default="", help="comma-separated bucket indices (default: all)")
    p.add_argument("--legacy-commit", default=LEGACY_COMMIT, help="git commit of the old path ('' = skip)")
    args = p.parse_args(argv)
    from app.bench.compute.drafter_jobs import bucket_job, default_arch
    from app.bench.feeding.pull_policies import rank_cost_spread
    from app.config.load import load_config
    from app.model.packing import split_rows

    cfg = load_config(args.config, SHAPES_ONLY)
    arch = default_arch(cfg)
    from app.bench.compute.step_peak import measure_step_peak

    fixed, modelled = fixed_bytes(arch)
    params = modelled // 4
    fused, foreach = measure_step_peak("fused"), measure_step_peak("foreach")
    step_extra = int(fused.per_param * params)  # the trainer's CUDA path: fused AdamW
    chunk, V = cfg.drafter.ce_chunk_rows, arch.vocab_size
    ce_ws = chunk * V * (2 + 4 + 2)
    mods = _legacy_modules(args.legacy_commit) if args.legacy_commit else None
    buckets = [int(b) for b in args.buckets.split(",")] if args.buckets else range(len(cfg.data.bucket_boundaries))
    staged = 2 * max(payload_bytes(arch, bucket_job(cfg, b)) for b in range(len(cfg.data.bucket_boundaries)))
    step_peak = fixed + step_extra + staged
    print(f"optimizer step, measured on the trainer's code: +{fused.per_param:.2f} B/param above the training state "
          f"({step_extra / GIB:.1f} GiB: the flat all-reduce buffer beside the gradients); AdamW itself "
          f"+{fused.adamw_per_param:.3f} B/param fused (CUDA) vs +{foreach.adamw_per_param:.2f} foreach "
          f"({foreach.adamw_per_param * params / GIB:.1f} GiB); peak at the step {step_peak / GIB:.1f} GiB")
    print(f"drafter: Qwen3-8B-shaped, {cfg.drafter.num_layers} layers, B={cfg.drafter.block_size}, "
          f"{cfg.drafter.num_anchors} anchors, max_rows={cfg.drafter.max_rows}; fixed state {fixed / GIB:.1f} GiB, "
          f"optimizer-step transient {step_extra / GIB:.1f} GiB, staged payloads {staged / GIB:.2f} GiB")
    print(f"{'bucket':>8} {'seqs':>5} {'rows':>7} {'subs':>4} {'saved GiB':>9} {'B/row':>9} {'peak GiB':>8}"
          f" | {'old GiB':>8} {'old B/row':>9} {'old peak':>8}")
    peaks, per_rows, legacy_rows, legacy_peaks = [], [], [], []
    for b in buckets:
        job = bucket_job(cfg, b)
        parts = split_rows(len(job.seq_M), job.block_size, cfg.drafter.max_rows)
        base, _ = _saved_new(arch, _one_block_job(job), slice(0, 1), chunk)
        saved, layer = max(_saved_new(arch, job, sl, chunk) for sl in parts[:1] + parts[-1:])
        rows = (parts[0].stop - parts[0].start) * job.block_size
        per_row = (saved - base) / rows
        peak = max(fixed + saved + layer + ce_ws, fixed + step_extra) + staged
        peaks.append(peak)
        per_rows.append(per_row)
        line = (f"{cfg.data.bucket_boundaries[b]:>8} {len(job.lengths):>5} {job.rows:>7} {len(parts):>4} "
                f"{saved / GIB:>9.1f} {per_row / 1e6:>8.3f}M {peak / GIB:>8.1f}")
        if mods:
            old = _saved_legacy(arch, job, chunk, mods)
            old_base = _saved_legacy(arch, _one_block_job(job), chunk, mods)
            old_row = (old - old_base) / job.rows
            old_peak = fixed + old + old / cfg.drafter.num_layers + ce_ws
            legacy_rows.append(old_row)
            legacy_peaks.append(old_peak)
            line += f" | {old / GIB:>8.1f} {old_row / 1e6:>8.3f}M {old_peak / GIB:>8.1f}"
        print(line, flush=True)
    spread = float(rank_cost_spread(cfg))
    worst, old_worst = max(per_rows), (max(legacy_rows) if legacy_rows else float("nan"))
    print(f"worst saved bytes per query row: {worst / 1e6:.3f} MB now vs {old_worst / 1e6:.3f} MB before "
          f"({worst / old_worst:.2f}x); max peak {max(peaks) / GIB:.1f} GiB now"
          + (f" vs {max(legacy_peaks) / GIB:.1f} GiB before" if legacy_peaks else ""))
    print(f"rank cost spread {spread:.3f}: app.bench.feeding.pull_policies.rank_cost_spread (the pool's dealing)")
    print_result({"max_peak_gib": f"{max(peaks) / GIB:.1f}", "saved_bytes_per_row": f"{worst:.0f}",
                  "legacy_saved_bytes_per_row": f"{old_worst:.0f}", "ratio": f"{worst / old_worst:.2f}",
                  "legacy_max_peak_gib": f"{(max(legacy_peaks) if legacy_peaks else float('nan')) / GIB:.1f}",
                  "rank_cost_spread": spread, "ce_recompute": 0, "step_extra_gib": f"{step_extra / GIB:.1f}",
                  "step_peak_gib": f"{step_peak / GIB:.1f}",
                  "adamw_foreach_gib": f"{foreach.adamw_per_param * params / GIB:.1f}",
                  "staged_payload_gib": f"{staged / GIB:.2f}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
