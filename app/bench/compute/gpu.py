"""`python -m app.bench gpu [--small] [--jobs N] [--drafter-jobs N] [--peak-tflops X] [--no-compile] [--acceptance]`.

`--acceptance [--part 1|2] [--results FILE] [--dry-run]` runs the checks a first GPU run must answer
instead, in two parts (what can crash, then what measures), one `RESULT check=... status=...` line each,
each check's time printed and appended to FILE (default runs/gpu-acceptance.jsonl) as it finishes
(app/bench/compute/gpu_acceptance.py); `--dry-run` walks that plan without running a check.

One script for a machine with one CUDA GPU, no downloads: a random-weight Qwen3-8B-shaped target in bf16
and the default drafter (conf/default.yaml's `drafter` and `train` sections) built around the target's own
embedding and LM head. Measures, with the code the actors run (`app.data.target_forward.start_job`; the
drafter's step loop, app/bench/compute/alone.py):
- target prefill tokens/s over jobs of the default schedule (synthetic chat-like lengths, as
  `python -m app.bench flops`), and MFU = needed FLOPs / time / peak (decoder layers up to the deepest
  requested one over the real tokens, causal attention);
- host-copy overlap: the share of the pinned device-to-host copy hidden behind the next job's forward
  ((serial - pipelined) / copy time, serial = forward then copy, pipelined = two jobs in flight);
- drafter step tokens/s (target tokens trained per second) and MFU = needed training FLOPs / time / peak
  (3x the forward of the drafter's own layers and fc, plus forward and input-gradient of the frozen LM
  head over the predicted rows; attention only over what the mask allows);
- peak GPU memory (`torch.cuda.max_memory_allocated`);
- transport: one 640 MiB payload's staging to the GPU from shared memory laid out as the object store,
  through a pinned copy vs straight from the page-locked mapping (app/bench/transport/gpu_staging.py).
The drafter half (its FLOPs and the timed steps) is app/bench/compute/gpu_drafter.py.
Ends `RESULT target_tok_s=... target_mfu=... drafter_tok_s=... drafter_mfu=... peak_gib=... transport_*=...`.
Budget: under 5 minutes on one H200 (the drafter compile is most of it; `--no-compile` skips it).

Without CUDA it exits 1 with one line, unless `--small`: the same code path at tiny shapes, on CUDA when
there is one, else on CPU (what the tests run). MFU peaks: H100/H200 989 TFLOP/s bf16 dense, A100 312;
elsewhere pass `--peak-tflops` (on CPU the default 1 TFLOP/s is nominal).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from app.bench.common import print_result
from app.bench.compute.gpu_drafter import bench_drafter, sync_device

PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0}
NO_CUDA = ("bench gpu: needs a CUDA GPU and torch sees none (torch.cuda.is_available() is False); run it on a GPU "
           "machine, or pass --small for the CPU rehearsal of the same code path")


@dataclass(frozen=True)
class Setup:
    """Shapes and sizes of one bench run."""

    device: torch.device
    dtype: torch.dtype
    target: object  # app.bench.compute.flops.Shape
    layer_ids: list[int]
    jobs: list[list[int]]  # sequence lengths per job
    drafter_jobs: int
    dcfg: object
    tcfg: object
    mask_token_id: int
    peak_flops: float


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m app.bench gpu")
    p.add_argument("--small", action="store_true", help="tiny shapes; runs on CPU when there is no CUDA")
    p.add_argument("--jobs", type=int, default=24, help="timed target jobs")
    p.add_argument("--drafter-jobs", type=int, default=6, help="timed drafter micro-batches")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="peak bf16 TFLOP/s for MFU (0 = from the GPU name)")
    p.add_argument("--no-compile", action="store_true", help="train.compile=off for the drafter")
    p.add_argument("--acceptance", action="store_true",
                   help="the first-GPU-run checks, one RESULT check=... line each (app/bench/compute/gpu_acceptance.py)")
    p.add_argument("--part", choices=("1", "2", "all"), default="all",
                   help="--acceptance: 1 = what can crash (under 4 min on an H200), 2 = what measures, all = both")
    p.add_argument("--results", default="runs/gpu-acceptance.jsonl",
                   help="--acceptance: JSON lines appended as each check ends ('' = none)")
    p.add_argument("--dry-run", action="store_true", help="--acceptance: walk the plan, run no check (any machine)")
    return p.parse_args(argv)


def peak_flops(device: torch.device, given: float) -> float:
    if given > 0:
        return given * 1e12
    if device.type != "cuda":
        return 1e12  # nominal: CPU MFU is not meaningful
    name = torch.cuda.get_device_name(device)
    for key, tf in PEAK_TFLOPS.items():
        if key in name:
            return tf * 1e12
    print(f"note: unknown GPU {name!r}; MFU against 989 TFLOP/s (pass --peak-tflops)")
    return 989.4e12


def make_setup(args) -> Setup:
    from app.bench.common import SHAPES_ONLY, bench_config
    from app.bench.compute.flops import LAYER_IDS, Shape, synthetic_lengths

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    compile_ = ["train.compile=off"] if args.no_compile else []
    if args.small:
        cfg = bench_config("tiny", compile_)
        shape = Shape(hidden=64, intermediate=128, layers=6, heads=4, kv_heads=2, head_dim=16, vocab=512)
        lengths = synthetic_lengths(400, max_length=cfg.data.max_length) // 6 + 8
        jobs = mixed_jobs(_jobs_for(lengths, cfg.data), args.jobs + 2)
        return Setup(device, torch.bfloat16 if cuda else torch.float32, shape, [1, 2, 3], jobs,
                     args.drafter_jobs, cfg.drafter, cfg.train, 3, peak_flops(device, args.peak_tflops))
    cfg = bench_config("default", [*SHAPES_ONLY, *compile_])
    jobs = mixed_jobs(_jobs_for(synthetic_lengths(), cfg.data), args.jobs + 2)
    return Setup(device, torch.bfloat16, Shape(), list(LAYER_IDS), jobs, args.drafter_jobs, cfg.drafter, cfg.train,
                 cfg.drafter.mask_token_id, peak_flops(device, args.peak_tflops))


def _jobs_for(lengths: np.ndarray, data) -> list[list[list[int]]]:
    from app.data.schedule import bucket_jobs

    return [[[int(lengths[i]) for i in j] for j in b] for b in bucket_jobs(lengths, data, epoch=0)]


def mixed_jobs(per_bucket: list[list[list[int]]], n: int) -> list[list[int]]:
    """Up to n jobs taken round-robin over the buckets, so every length class is in the timing (all
    of them when the schedule holds fewer than n)."""
    out: list[list[int]] = []
    for i in range(max((len(b) for b in per_bucket), default=0)):  # a round past the longest adds nothing
        out += [b[i] for b in per_bucket if i < len(b)][: n - len(out)]
    return out


def build_target(s: Setup):
    """Random-weight Qwen3 CausalLM of the setup's shape on its device, in its dtype (std 0.02 init)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from app.devices import target_attention

    sh = s.target
    cfg = Qwen3Config(vocab_size=sh.vocab, hidden_size=sh.hidden, intermediate_size=sh.intermediate,
                      num_hidden_layers=sh.layers, num_attention_heads=sh.heads, num_key_value_heads=sh.kv_heads,
                      head_dim=sh.head_dim, max_position_embeddings=40960, tie_word_embeddings=False,
                      attn_implementation=target_attention(s.device, s.dtype))
    old = torch.get_default_dtype()
    torch.set_default_dtype(s.dtype)  # weights are born in bf16: no fp32 copy of 8B parameters
    try:
        with torch.device(s.device):
            torch.manual_seed(0)
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval().requires_grad_(False)


def job_seqs(lengths: list[int], vocab: int, rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random token ids; the loss covers everything after the first quarter (the 'assistant' part)."""
    out = []
    for n in lengths:
        mask = (np.arange(n) >= n // 4).astype(np.uint8)
        out.append((rng.integers(0, vocab, n), mask))
    return out


def bench_target(s: Setup, model) -> tuple[dict, list]:
    """Prefill tok/s and MFU, and the copy overlap; returns the last jobs' HiddenBatches for the drafter."""
    from app.bench.compute.flops import target_flops
    from app.data.target_forward import run_target, start_job, to_host_async, use_packing, pad_sequences
    from app.model.target_trunk import TargetTrunk

    trunk = TargetTrunk(model, s.layer_ids)
    rng = np.random.default_rng(0)
    seqs = [job_seqs(j, s.target.vocab, rng) for j in s.jobs]
    packed = use_packing(model, s.device)
    for j in range(2):  # warm-up (kernels, allocator, pinned-memory cache)
        start_job(trunk, seqs[j], j, s.device).result()
    timed = list(range(2, len(seqs)))
    real = sum(sum(s.jobs[j]) for j in timed)
    needed = sum(target_flops(s.target, s.jobs[j], "needed", s.layer_ids) for j in timed)

    # 1) forward only (features stay on the device)
    sync_device(s.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for j in timed:
            ids_BS, _, lengths_B = pad_sequences(seqs[j])
            run_target(trunk, ids_BS, lengths_B, s.device, packed)
    sync_device(s.device)
    fwd_s = time.perf_counter() - t0
    # 2) the copy alone: device features of one job to pinned host, timed per job
    copy_s = 0.0
    with torch.inference_mode():
        for j in timed:
            ids_BS, _, lengths_B = pad_sequences(seqs[j])
            feats = run_target(trunk, ids_BS, lengths_B, s.device, packed)
            sync_device(s.device)
            t1 = time.perf_counter()
            host, done = to_host_async(feats)
            if done is not None:
                done.synchronize()
            copy_s += time.perf_counter() - t1
    # 3) serial: each job's forward, then its copy, then the next
    sync_device(s.device)
    t0 = time.perf_counter()
    for j in timed:
        start_job(trunk, seqs[j], j, s.device).result()
    serial_s = time.perf_counter() - t0
    # 4) pipelined: the next job is issued before the previous one's copy is awaited (two in flight)
    batches = []
    t0 = time.perf_counter()
    pending = None
    keep = s.drafter_jobs + 2  # the drafter's batches; older ones go (each is ~0.7 GB of pinned host memory)
    for j in timed:
        nxt = start_job(trunk, seqs[j], j, s.device)
        if pending is not None:
            batches = [*batches, pending.result()][-keep:]
        pending = nxt
    batches = [*batches, pending.result()][-keep:]
    piped_s = time.perf_counter() - t0
    trunk.remove()
    # On CPU there is no copy to hide (the features already live on the host): overlap is n/a there.
    overlap = min(1.0, max(0.0, (serial_s - piped_s) / copy_s)) if s.device.type == "cuda" else float("nan")
    res = {"tok_s": real / piped_s, "fwd_tok_s": real / fwd_s, "mfu": needed / fwd_s / s.peak_flops,
           "mfu_pipelined": needed / piped_s / s.peak_flops, "copy_s_per_job": copy_s / len(timed),
           "serial_s": serial_s, "piped_s": piped_s, "overlap": overlap, "packed": packed,
           "attn": model.config._attn_implementation, "tokens": real}
    return res, batches


def main(argv: list[str]) -> int:
    args = parse(argv)
    parts = (1, 2) if args.part == "all" else (int(args.part),)
    if args.acceptance and args.dry_run:
        from app.bench.compute.gpu_acceptance import run_acceptance

        return run_acceptance(None, {}, parts, args.results or None, dry_run=True)
    if not args.small and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 1
    if args.acceptance:
        from app.bench.compute.gpu_acceptance import run_acceptance

        return run_acceptance(make_setup(args), {"build_target": build_target, "bench_target": bench_target,
                                                 "bench_drafter": bench_drafter}, parts, args.results or None,
                              small=args.small)
    t_start = time.perf_counter()
    s = make_setup(args)
    where = torch.cuda.get_device_name(s.device) if s.device.type == "cuda" else "CPU"
    print(f"device: {where}, dtype {s.dtype}, target {s.target}, layer_ids {s.layer_ids}, "
          f"{len(s.jobs) - 2} timed jobs (+2 warm-up), peak {s.peak_flops / 1e12:.0f} TFLOP/s")
    model = build_target(s)
    if s.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(s.device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    t, batches = bench_target(s, model)
    target_peak = torch.cuda.max_memory_allocated(s.device) if s.device.type == "cuda" else 0
    print(f"target: {t['tok_s']:.0f} tok/s with host copies ({t['fwd_tok_s']:.0f} forward only), MFU "
          f"{t['mfu']:.3f} (forward only; {t['mfu_pipelined']:.3f} with copies), attention {t['attn']}, "
          f"packed={t['packed']}, {t['tokens']} real tokens")
    print(f"host copy: {t['copy_s_per_job'] * 1e3:.1f} ms per job alone; serial {t['serial_s']:.2f} s vs two in "
          f"flight {t['piped_s']:.2f} s: overlap {t['overlap']:.2f}")
    d = bench_drafter(s, model, batches)
    peak = torch.cuda.max_memory_allocated(s.device) if s.device.type == "cuda" else 0
    print(f"drafter: {d['tok_s']:.0f} tok/s, MFU {d['mfu']:.3f}, {d['step_s']:.2f} s per micro-batch, warm-up "
          f"(compile) {d['warm_s']:.1f} s")
    from app.bench.transport import gpu_staging as gpu_transport

    del model, batches  # the transport part needs the host and device memory of one 640 MiB job twice
    tr = gpu_transport.bench_transport(s.device, gpu_transport.SMALL_BYTES if args.small else gpu_transport.FULL_BYTES)
    print(gpu_transport.line(tr))
    print(f"memory: weights {weights / 2**30:.1f} GiB, target phase peak {target_peak / 2**30:.1f} GiB, overall peak "
          f"{peak / 2**30:.1f} GiB; wall {time.perf_counter() - t_start:.0f} s")
    print_result({"target_tok_s": f"{t['tok_s']:.0f}", "target_mfu": t["mfu"], "drafter_tok_s": f"{d['tok_s']:.0f}",
                  "drafter_mfu": d["mfu"], "peak_gib": f"{peak / 2**30:.1f}", "copy_overlap": f"{t['overlap']:.2f}",
                  **gpu_transport.fields(tr), "device": "cuda" if s.device.type == "cuda" else "cpu-small"})
    return 0
