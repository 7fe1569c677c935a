"""`python -m app.bench gpu --acceptance [--small]`: what a first GPU run must answer, in under 8 minutes.

Each check ends in one `RESULT check=<name> status=pass|fail|skipped [key=value ...]` line, in order:
- `environment`: torch and its CUDA, the GPU, flash-attn really imported (not just found), accelerate
  (targets load straight onto the GPU only with it);
- `cuda_tests`: `pytest tests/test_model_cuda.py` (flex vs dense both ways, staging, compiled step);
- `target_prefill`, `drafter_step`: tokens/s and MFU of the target's prefill and of the drafter's
  training step, with the code the actors run (`app.bench.compute.gpu`'s own measurements, fewer jobs);
- `drafter_memory`: a compiled drafter step per bucket at the real shapes (Qwen3-8B-shaped target,
  conf/default.yaml's drafter) with its peak memory against the README's figure (`bench memory`);
- `resume`: a checkpoint saved and resumed on the device: optimizer and RNG restored, and one more step
  after the resume equals one more step of the original.
Without CUDA (`--small` on CPU) the CUDA-only checks print `status=skipped reason=no_cuda`; the others
run at tiny shapes. Exits 1 when a check failed.
"""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import torch

from app.bench.common import ROOT, SHAPES_ONLY, bench_config, print_result

README_PEAK_GIB = 75.0  # README, "python -m app.bench memory": the drafter's max predicted peak per rank


def result(check: str, status: str, **kv) -> None:
    print_result({"check": check, "status": status, **kv})


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


def cuda_tests(_ctx) -> tuple[str, dict]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_model_cuda.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "no output"
    print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n")
    return ("pass" if proc.returncode == 0 else "fail"), {"summary": "_".join(tail.split())}


def target_prefill(ctx) -> tuple[str, dict]:
    bench = ctx["bench"]
    ctx["model"] = bench["build_target"](ctx["setup"])
    t, ctx["batches"] = bench["bench_target"](ctx["setup"], ctx["model"])
    return "pass", {"tok_s": f"{t['tok_s']:.0f}", "mfu": f"{t['mfu']:.3f}", "attn": t["attn"],
                    "copy_overlap": f"{t['overlap']:.2f}"}


def drafter_step(ctx) -> tuple[str, dict]:
    d = ctx["bench"]["bench_drafter"](ctx["setup"], ctx["model"], ctx["batches"])
    return "pass", {"tok_s": f"{d['tok_s']:.0f}", "mfu": f"{d['mfu']:.3f}", "warm_s": f"{d['warm_s']:.1f}"}


def drafter_memory(ctx) -> tuple[str, dict]:
    """One compiled micro-batch and step per bucket at the real shapes; peak beyond the target's own
    decoder weights (the bench counts the frozen embedding and LM head, not the rest of the target)."""
    from app.bench.compute.drafter_jobs import bucket_job

    s, model = ctx["setup"], ctx["model"]
    cfg = bench_config("default", SHAPES_ONLY)
    trainer, arch = _trainer(s, model)
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
    return ("pass" if same else "fail"), {"loss_after_resume": f"{runs[1][0]:.6f}", "device": device.type}


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


CHECKS = [("environment", environment, False), ("cuda_tests", cuda_tests, True),
          ("target_prefill", target_prefill, False), ("drafter_step", drafter_step, False),
          ("drafter_memory", drafter_memory, True), ("resume", resume, False)]


def run_acceptance(setup, bench: dict) -> int:
    """`setup`: app.bench.compute.gpu's Setup; `bench`: its build_target, bench_target and bench_drafter."""
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    ctx = {"setup": setup, "bench": bench}
    failed = []
    for name, check, needs_cuda in CHECKS:
        if needs_cuda and not cuda:
            result(name, "skipped", reason="no_cuda")
            continue
        t1 = time.perf_counter()
        try:
            status, kv = check(ctx)
        except Exception as e:  # noqa: BLE001 -- one failing check is reported, and the next ones still run
            status, kv = "fail", {"error": type(e).__name__, "message": "_".join(str(e).split())[:160]}
        failed += [name] if status == "fail" else []
        result(name, status, seconds=f"{time.perf_counter() - t1:.1f}", **kv)
    print(f"acceptance: {len(CHECKS) - len(failed)}/{len(CHECKS)} checks not failed in "
          f"{time.perf_counter() - t0:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
