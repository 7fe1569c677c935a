"""`python -m app.bench flops` (drafter side): executed vs needed drafter attention FLOPs.

For one drafter micro-batch of `conf/default.yaml` (Qwen3-8B-shaped drafter: 32 heads of 128, 5
layers, B=16, 512 anchors; the job mix of `app/bench/compute/drafter_jobs.py`), forward attention FLOPs
(QK^T and PV: 4 x head_dim per query-key pair per head per layer):
- needed: each block row against the context strictly before its anchor plus its own B keys;
- old: the dense masked SDPA over [A_max*B, S + A_max*B] per sequence (padded anchors included);
- flex (the CUDA path): every 128x128 BlockMask tile holding a visible pair, computed in full;
- tiled (the CPU path): each tile's rows x (context range + own keys).
The headline is the default-shape job (the 3,072 bucket: the issue's S=3,072 x 512 anchors case);
every bucket is printed, with the row-weighted mix over all buckets. The counts are host arithmetic
on the real plan; tests check the tiled count against torch.utils.flop_counter and the flex count
against the BlockMask torch builds.
Ends `RESULT drafter_attn_flops_ratio=... (flex, default job) old_ratio=... tiled_ratio=... mix_ratio=...`.
"""
from __future__ import annotations

import argparse
import sys

from app.bench.common import SHAPES_ONLY, bench_config, print_result


def job_attention_flops(job, heads: int, head_dim: int, layers: int) -> dict[str, float]:
    """Forward attention FLOPs of one micro-batch: needed, old (dense padded), flex, tiled."""
    import torch

    from app.model.attention import FLEX_TILE, attention_flops
    from app.model.packing import pack_blocks

    B = job.block_size
    S = int(job.lengths.max())
    cpu = torch.device("cpu")
    per_pair = 4 * head_dim * heads * layers
    # Each kernel on the layout it gets: flex packs context at 128-token alignment, tiled packs tight.
    p = pack_blocks(job.seq_M, job.anchors_M, job.lengths, S, B, cpu, "none", align=FLEX_TILE).plan
    flex, needed = attention_flops(p.ctx_lo_M, p.ctx_hi_M, p.num_ctx, B, "flex")
    p = pack_blocks(job.seq_M, job.anchors_M, job.lengths, S, B, cpu, "none", align=1).plan
    tiled, _ = attention_flops(p.ctx_lo_M, p.ctx_hi_M, p.num_ctx, B, "tiled")
    Q = job.max_anchors() * B  # the old layout: every sequence padded to the most anchors
    old = len(job.lengths) * Q * (S + Q)
    return {k: v * per_pair for k, v in
            {"needed": needed, "old": old, "flex": flex, "tiled": tiled}.items()}


def drafter_attention_flops(config: str | None = None) -> dict:
    """Per bucket and for the default-shape job: FLOPs by path (a function the flops bench calls)."""
    from app.bench.compute.drafter_jobs import bucket_job, default_arch
    from app.config.load import load_config

    cfg = load_config(config, SHAPES_ONLY) if config else bench_config("default", SHAPES_ONLY)
    arch = default_arch(cfg)
    per_bucket = {}
    for b, bound in enumerate(cfg.data.bucket_boundaries):
        job = bucket_job(cfg, b, pick="longest")
        per_bucket[bound] = (job, job_attention_flops(job, arch.num_heads, arch.head_dim, arch.num_layers))
    return {"cfg": cfg, "per_bucket": per_bucket, "default": per_bucket[max(per_bucket)]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.bench.compute.flops_drafter", description=__doc__.splitlines()[2])
    p.add_argument("--drafter-config", default=None)
    args, _ = p.parse_known_args(argv)
    res = drafter_attention_flops(args.drafter_config)
    print(f"{'bucket':>7} {'seqs':>4} {'rows':>7} {'needed TF':>9} {'old/need':>8} {'flex/need':>9} {'tiled/need':>10}")
    tot = dict.fromkeys(("needed", "old", "flex", "tiled"), 0.0)
    for bound, (job, f) in res["per_bucket"].items():
        for k in tot:
            tot[k] += f[k] * job.rows  # weighted by rows: every bucket at its drafter cost share
        print(f"{bound:>7} {len(job.lengths):>4} {job.rows:>7} {f['needed'] / 1e12:>9.2f} {f['old'] / f['needed']:>8.2f} "
              f"{f['flex'] / f['needed']:>9.2f} {f['tiled'] / f['needed']:>10.2f}")
    job, f = res["default"]
    mix = {k: tot[k] / tot["needed"] for k in tot}
    print(f"default-shape job ({len(job.lengths)} seqs up to {int(job.lengths.max())} tokens, {job.rows} rows): "
          f"old {f['old'] / f['needed']:.2f}x, flex {f['flex'] / f['needed']:.2f}x, tiled {f['tiled'] / f['needed']:.2f}x "
          f"of needed; row-weighted over buckets: old {mix['old']:.2f}x, flex {mix['flex']:.2f}x, tiled {mix['tiled']:.2f}x")
    print_result({"drafter_attn_flops_ratio": f["flex"] / f["needed"], "old_ratio": f["old"] / f["needed"],
                  "tiled_ratio": f["tiled"] / f["needed"], "mix_ratio": mix["flex"], "mix_old_ratio": mix["old"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
