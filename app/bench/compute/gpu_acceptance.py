"""`python -m app.bench gpu --acceptance [--part 1|2] [--results FILE] [--dry-run] [--small]`.

What a first GPU run must answer, in two parts (app/bench/compute/acceptance_runner.py runs them, prints
each check's time as it ends and appends it to the results file at once). Each check ends in one
`RESULT check=<name> status=pass|fail|skipped part=N seconds=S [key=value ...]` line.

Part 1, what can crash a run (budget 4 minutes on an H200, cold compile cache included), cheapest first:
- `environment`: torch and its CUDA, the GPU, flash-attn really imported (not just found), accelerate;
- `collective`: a one-rank process group through the run's rendezvous (nccl on CUDA, gloo on CPU):
  all-reduce and broadcast of 4 MiB, then torn down (one GPU holds one NCCL rank: issue 37 item 1);
- `resume`: a checkpoint saved and resumed on the device: optimizer (fused AdamW on CUDA) and RNG
  restored, and one more step after the resume equals one more step of the original;
- `cuda_tests`: `pytest tests/test_model_cuda.py` (flex vs dense forward and backward, staging, compiled
  step), cut at 150 s;
- `real_step`: the random-weight Qwen3-8B-shaped target built, and one compiled drafter micro-batch and
  optimizer step on the setup's largest job (conf/default.yaml's drafter: the real shapes).
Part 2, what measures:
- `target_prefill`, `drafter_step`: tokens/s and MFU of the target's prefill and of the drafter's
  training step, with the code the actors run (`app.bench.compute.gpu`'s own measurements, fewer jobs);
- `drafter_memory`: a compiled drafter step per bucket at the real shapes with its peak memory against
  the README's figure (`bench memory`);
- `target_spread` (2+ GPUs, else skipped): the target over two GPUs (topology.gpus_per_target=2), its
  features against the one-GPU ones and prefill tokens/s both ways;
- `transport`: one payload staged from shared memory to the device, pinned copy vs the registered mapping.
Without CUDA (`--small` on CPU) the CUDA-only checks print `status=skipped reason=no_cuda`; the others
run at tiny shapes. `--dry-run` walks the plan without running a check (on any machine, in a second).
Exits 1 when a check failed.
"""
from __future__ import annotations

import math
import subprocess
import sys
import time

import numpy as np
import torch

from app.bench.common import ROOT, SHAPES_ONLY, bench_config
from app.bench.compute.acceptance_runner import Check, run_checks, summary

README_PEAK_GIB = 75.0  # README, "python -m app.bench memory": the drafter's max predicted peak per rank


def environment(_ctx) -> tuple[str, dict]:
    from transformers.utils import is_accelerate_available

    from app.devices import flash_attn_usable

    cuda = torch.cuda.is_available()
    kv = {"torch": torch.__version__, "torch_cuda": torch.version.cuda or "none", "cuda": int(cuda),
          "flash_attn": int(flash_attn_usable()), "accelerate": int(is_accelerate_available())}
    if not cuda:
        return "skipped", {"reason": "no_cuda", **kv}
    kv["gpu"] = torch.cuda.get_device_name(0).replace(" ", "_")
    return "pass", kv


CUDA_TESTS_TIMEOUT_S = 150  # a cold compile past this would not fit part 1's window: a failure, named


def cuda_tests(_ctx) -> tuple[str, dict]:
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "tests/test_model_cuda.py"], cwd=ROOT, capture_output=True, text=True,
                              timeout=CUDA_TESTS_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(out[-3000:])
        return "fail", {"reason": f"timeout_{CUDA_TESTS_TIMEOUT_S}s"}
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "no output"
    print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n")
    return ("pass" if proc.returncode == 0 else "fail"), {"summary": "_".join(tail.split())}


def collective(ctx) -> tuple[str, dict]:
    """A one-rank group through the run's rendezvous and backend; all-reduce and broadcast, torn down."""
    import torch.distributed as dist

    from app.training.rendezvous import Rendezvous

    device = ctx["setup"].device
    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():
        return "fail", {"reason": "a_process_group_is_already_initialized"}
    rendezvous = Rendezvous()
    addr, port = rendezvous.listen("127.0.0.1")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=rendezvous.store(addr, port, 1, True), rank=0, world_size=1)
    try:
        flat = torch.arange(1 << 20, device=device, dtype=torch.float32)
        dist.all_reduce(flat)
        dist.broadcast(flat, src=0)
        ok = int(flat[-1].item()) == (1 << 20) - 1
    finally:
        dist.destroy_process_group()
    return ("pass" if ok else "fail"), {"backend": backend, "mib": 4}


def _target(ctx):
    """The setup's random-weight target, built once and shared by the checks that need it."""
    if "model" not in ctx:
        ctx["model"] = ctx["bench"]["build_target"](ctx["setup"])
    return ctx["model"]


def _drafter(ctx):
    """(trainer, arch) of the setup's drafter on the target, built (and compiled) once."""
    if "drafter" not in ctx:
        ctx["drafter"] = _trainer(ctx["setup"], _target(ctx))
    return ctx["drafter"]


def real_step(ctx) -> tuple[str, dict]:
    """One micro-batch and optimizer step of the drafter on the setup's largest job (compiled on CUDA)."""
    from app.training.trainer import use_compile

    s = ctx["setup"]
    trainer, arch = _drafter(ctx)
    lengths = max(s.jobs, key=sum)
    batch = _random_batch(lengths, arch, s.device, s.dtype)
    trainer.micro_step(batch, job_id=0)
    stats = trainer.finish_step()
    if s.device.type == "cuda":
        torch.cuda.synchronize(s.device)
    ok = math.isfinite(stats.loss) and math.isfinite(stats.grad_norm) and stats.grad_norm > 0 and not stats.nonfinite
    return ("pass" if ok else "fail"), {"seqs": len(lengths), "tokens": sum(lengths), "loss": f"{stats.loss:.4f}",
                                        "compiled": int(use_compile(s.tcfg.compile, s.device))}


def target_prefill(ctx) -> tuple[str, dict]:
    bench = ctx["bench"]
    t, ctx["batches"] = bench["bench_target"](ctx["setup"], _target(ctx))
    return "pass", {"tok_s": f"{t['tok_s']:.0f}", "mfu": f"{t['mfu']:.3f}", "attn": t["attn"],
                    "copy_overlap": f"{t['overlap']:.2f}"}


def drafter_step(ctx) -> tuple[str, dict]:
    if "batches" not in ctx:  # part 2 alone: target_prefill makes them
        target_prefill(ctx)
    d = ctx["bench"]["bench_drafter"](ctx["setup"], _target(ctx), ctx.pop("batches"))  # pinned host memory freed
    return "pass", {"tok_s": f"{d['tok_s']:.0f}", "mfu": f"{d['mfu']:.3f}", "warm_s": f"{d['warm_s']:.1f}"}


def drafter_memory(ctx) -> tuple[str, dict]:
    """One compiled micro-batch and step per bucket at the real shapes; peak beyond the target's own
    decoder weights (the bench counts the frozen embedding and LM head, not the rest of the target)."""
    from app.bench.compute.drafter_jobs import bucket_job

    s, model = ctx["setup"], _target(ctx)
    cfg = bench_config("default", SHAPES_ONLY)
    trainer, arch = _drafter(ctx)  # compiled once, in part 1's real_step
    target_rest = sum(p.numel() * p.element_size() for p in model.parameters()) - \
        sum(p.numel() * p.element_size() for p in (model.model.embed_tokens.weight, model.lm_head.weight))
    peaks = []
    for b in range(len(cfg.data.bucket_boundaries)):
        lengths = bucket_job(cfg, b).lengths
        batch = _random_batch(lengths, arch, s.device, s.dtype)
        torch.cuda.reset_peak_memory_stats(s.device)
        trainer.micro_step(batch, job_id=b)
        trainer.finish_step()
        torch.cuda.synchronize(s.device)
        peaks.append((torch.cuda.max_memory_allocated(s.device) - target_rest) / 2**30)
        del batch
    worst = max(peaks)
    kv = {f"bucket{cfg.data.bucket_boundaries[i]}_gib": f"{p:.1f}" for i, p in enumerate(peaks)}
    return ("pass" if worst <= README_PEAK_GIB * 1.05 else "fail"), {"max_gib": f"{worst:.1f}",
                                                                     "readme_gib": README_PEAK_GIB, **kv}


def _trainer(s, model):
    from dataclasses import replace

    from app.model.arch import DrafterArch
    from app.model.drafter import DFlashDrafter
    from app.model.target_head import TargetHead
    from app.training.trainer import DrafterTrainer

    dcfg = replace(s.dcfg, mask_token_id=s.mask_token_id)
    arch = DrafterArch.from_target(model.config, dcfg, s.layer_ids)
    drafter = DFlashDrafter(arch).to(s.device, torch.float32)
    head = TargetHead(model.model.embed_tokens.weight, model.lm_head.weight)
    autocast = s.dtype if s.dtype != torch.float32 else None
    return DrafterTrainer(drafter, head, dcfg, s.tcfg, total_steps=100, device=s.device, autocast=autocast), arch


def _random_batch(lengths, arch, device, dtype):
    from app.model.loss import TrainBatch

    N, S = len(lengths), int(max(lengths))
    g = torch.Generator(device=device).manual_seed(0)
    lengths_t = torch.as_tensor(np.asarray(lengths), device=device)
    mask = (torch.arange(S, device=device)[None] < lengths_t[:, None]).float()
    ids = torch.randint(0, arch.vocab_size, (N, S), device=device, generator=g)
    hidden = torch.randn(N, S, arch.feature_dim, device=device, dtype=dtype, generator=g)
    return TrainBatch(ids, mask, hidden, lengths_t)


def resume(ctx) -> tuple[str, dict]:
    """Save after one step, resume into a fresh trainer on the device; the next step must agree."""
    import tempfile

    from app.training.checkpoint import TrainState, load_checkpoint, restore_rng, rng_state, save_checkpoint

    device, toy_parts = ctx["setup"].device, _tiny_trainer
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        trainer, batch = toy_parts(device)
        trainer.micro_step(batch, 1)
        trainer.finish_step()
        state = TrainState(step=1, epoch=0, ledger=[], drafter=trainer.drafter.state_dict(),
                           optimizer=trainer.optimizer.state_dict(), scheduler=trainer.scheduler.state_dict(),
                           rng=rng_state())
        path = save_checkpoint(tmp, state, keep=1)
        for restored in (False, True):
            if restored:
                trainer, batch = toy_parts(device)
                loaded = load_checkpoint(path, map_location=str(device))
                trainer.drafter.load_state_dict(loaded.drafter)
                trainer.optimizer.load_state_dict(loaded.optimizer)
                trainer.scheduler.load_state_dict(loaded.scheduler)
            restore_rng(state.rng if not restored else loaded.rng)
            trainer.micro_step(batch, 2)
            stats = trainer.finish_step()
            runs.append((stats.loss, [p.detach().clone() for p in trainer.drafter.parameters()]))
    # allclose, not equal: flex's CUDA backward accumulates with atomics (not bit-reproducible)
    same = abs(runs[0][0] - runs[1][0]) <= 1e-5 * abs(runs[0][0]) and \
        all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(runs[0][1], runs[1][1]))
    adamw = "fused" if trainer.optimizer.param_groups[0]["fused"] else "foreach"
    return ("pass" if same else "fail"), {"loss_after_resume": f"{runs[1][0]:.6f}", "device": device.type,
                                          "adamw": adamw}


def _tiny_trainer(device):
    """A 2-layer drafter (head_dim 16, as flex on CUDA needs) with its trainer and a fixed random batch."""
    from app.config.drafter_sections import DrafterConfig, TrainConfig
    from app.model.arch import DrafterArch
    from app.model.drafter import DFlashDrafter
    from app.model.target_head import TargetHead
    from app.training.trainer import DrafterTrainer

    target = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
              "head_dim": 16, "intermediate_size": 128, "vocab_size": 256}
    dcfg = DrafterConfig(num_layers=2, block_size=4, num_anchors=8, mask_token_id=3)
    arch = DrafterArch.from_target(target, dcfg, [0, 2])
    torch.manual_seed(0)
    drafter = DFlashDrafter(arch).to(device)
    g = torch.Generator().manual_seed(1)
    head = TargetHead(torch.randn(256, 64, generator=g).to(device), torch.randn(256, 64, generator=g).to(device))
    trainer = DrafterTrainer(drafter, head, dcfg, TrainConfig(compile="off"), total_steps=10, device=device)
    return trainer, _random_batch([40, 27, 33], arch, device, torch.float32)


def target_spread(ctx) -> tuple[str, dict]:
    """topology.gpus_per_target=2 on this machine's first two GPUs (app/bench/compute/gpu_spread.py)."""
    from app.bench.compute.gpu_spread import spread_prefill

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        return "skipped", {"reason": "needs_2_gpus", "gpus": gpus}
    ctx.pop("drafter", None)  # GPU 0 holds the target alone, as a target actor's GPU does
    status, kv, ctx["model"] = spread_prefill(ctx["setup"], _target(ctx))
    return status, kv


def transport(ctx) -> tuple[str, dict]:
    """One payload staged to the device: pinned copy vs the registered mapping (app/bench/transport/gpu_staging.py)."""
    from app.bench.transport import gpu_staging

    for key in ("drafter", "model", "batches"):  # the staging needs the host and device memory of a job twice
        ctx.pop(key, None)
    nbytes = gpu_staging.SMALL_BYTES if ctx.get("small") else gpu_staging.FULL_BYTES
    r = gpu_staging.bench_transport(ctx["setup"].device, nbytes)
    print(gpu_staging.line(r))
    return ("pass" if r["equal"] else "fail"), gpu_staging.fields(r)


# Budgets: seconds on an H200 with cold caches, estimated from the files (not yet measured on one).
CHECKS = [
    Check("environment", environment, 1, False, 5), Check("collective", collective, 1, False, 15),
    Check("resume", resume, 1, False, 30), Check("cuda_tests", cuda_tests, 1, True, 110),
    Check("real_step", real_step, 1, False, 80),
    Check("target_prefill", target_prefill, 2, False, 60), Check("drafter_step", drafter_step, 2, False, 60),
    Check("drafter_memory", drafter_memory, 2, True, 90), Check("target_spread", target_spread, 2, True, 60),
    Check("transport", transport, 2, False, 30),
]


def run_acceptance(setup, bench: dict, parts: tuple[int, ...] = (1, 2), results: str | None = None,
                   dry_run: bool = False, small: bool = False) -> int:
    """`setup`: app.bench.compute.gpu's Setup (None for a dry run); `bench`: its build_target, bench_target and
    bench_drafter. Exits 1 when a check failed."""
    t0 = time.perf_counter()
    ctx = {"setup": setup, "bench": bench, "small": small}
    outcomes = run_checks(CHECKS, ctx, parts, torch.cuda.is_available(), results, dry_run)
    line, code = summary(outcomes, time.perf_counter() - t0)
    print(line + (f"; results in {results}" if results else ""), flush=True)
    return code
