"""`python -m app.bench loss [--rows 8192 --vocab 151936 --hidden 64 --chunk 1024]`

Peak memory and time of the chunked LM-head cross-entropy against full logits, forward + backward,
for the same rows, vocabulary and hidden size: `weighted` (the training path: input gradient computed
in the forward, no logits recompute), `chunked` (recomputes each chunk's logits in backward), `full`. Each variant runs in its own fresh subprocess, one after the
other, and reports its peak resident memory above the resident memory after setup (torch's CPU
allocations bypass tracemalloc, so RSS is the honest number). Ends with
`RESULT chunked_peak_mb=... full_peak_mb=... ratio=... weighted_s=... chunked_s=... recompute_cost=...`
(ratio = full / chunked peak; recompute_cost = chunked / weighted seconds).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from app.bench.common import print_result

def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _worker(mode: str, rows: int, vocab: int, hidden: int, chunk: int) -> dict:
    import torch

    from app.model.chunked_ce import chunked_cross_entropy, full_cross_entropy, weighted_chunked_ce

    torch.manual_seed(0)
    h = torch.randn(rows, hidden, requires_grad=True)
    W = torch.randn(vocab, hidden) * 0.05
    y = torch.randint(0, vocab, (rows,))
    w = torch.rand(rows)
    base = _rss_mb()
    t0 = time.perf_counter()
    if mode == "weighted":
        loss = weighted_chunked_ce(h, W, y, w, chunk)[0]
    elif mode == "chunked":
        loss = (chunked_cross_entropy(h, W, y, chunk)[0] * w).sum()
    else:
        loss = (full_cross_entropy(h, W, y) * w).sum()
    loss.backward()
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"mode": mode, "peak_mb": peak - base, "seconds": dt, "loss": float(loss), "grad_norm": float(h.grad.norm())}


def _run(mode: str, args) -> dict:
    cmd = [sys.executable, "-m", "app.bench.compute.loss", "--worker", mode, "--rows", str(args.rows), "--vocab",
           str(args.vocab), "--hidden", str(args.hidden), "--chunk", str(args.chunk)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} worker failed (rc {out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.bench loss", description=__doc__.splitlines()[2])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--worker", choices=("weighted", "chunked", "full"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args.worker, args.rows, args.vocab, args.hidden, args.chunk)))
        return 0
    logits_mb = args.rows * args.vocab * 4 / 2**20
    print(f"rows={args.rows} vocab={args.vocab} hidden={args.hidden} chunk={args.chunk}: "
          f"one fp32 logits tensor = {logits_mb:.0f} MiB")
    weighted = _run("weighted", args)
    chunked = _run("chunked", args)
    full = _run("full", args)
    for r in (weighted, chunked, full):
        print(f"  {r['mode']:8s} peak +{r['peak_mb']:8.1f} MiB  {r['seconds']:6.2f} s  loss {r['loss']:.4f}")
    same = all(abs(r["loss"] - full["loss"]) <= 1e-4 * abs(full["loss"]) for r in (weighted, chunked))
    same = same and abs(weighted["grad_norm"] - full["grad_norm"]) <= 1e-3 * full["grad_norm"]
    ratio = full["peak_mb"] / max(chunked["peak_mb"], 1e-9)
    print(f"full/chunked peak memory: {ratio:.1f}x; losses agree: {same}")
    print_result({"chunked_peak_mb": f"{chunked['peak_mb']:.1f}", "full_peak_mb": f"{full['peak_mb']:.1f}",
                  "ratio": f"{ratio:.2f}", "chunked_s": f"{chunked['seconds']:.2f}", "full_s": f"{full['seconds']:.2f}",
                  "losses_agree": int(same), "weighted_peak_mb": f"{weighted['peak_mb']:.1f}",
                  "weighted_s": f"{weighted['seconds']:.2f}",
                  "recompute_cost": f"{chunked['seconds'] / max(weighted['seconds'], 1e-9):.2f}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
