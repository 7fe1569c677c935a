"""The `target_spread` check of `bench gpu --acceptance` (2+ GPUs): topology.gpus_per_target=2 as a target
actor runs it. The random-weight target, built on GPU 0, is timed on a few jobs' prefill (the actors' code:
TargetTrunk through app.data.target_forward.run_target), then dispatched by accelerate over GPUs 0 and 1 with the
plan a target actor loads with (app/devices.py plan_target_map) and timed again; the features (gathered on
GPU 0, where the payload is built) must match the one-GPU ones. Prefill tokens/s both ways say what a second
GPU per target buys against a second target (which doubles tokens/s, where the weights fit one GPU).
"""
from __future__ import annotations

import time

import numpy as np
import torch


def spread_prefill(s, model, jobs_used: int = 4):
    """(status, fields, the dispatched model): `s` is bench gpu's Setup, `model` its target on GPU 0."""
    from accelerate import dispatch_model

    from app.data.target_forward import pad_sequences, run_target, use_packing
    from app.devices import TARGET_WEIGHT_SHARE, plan_target_map
    from app.model.target_trunk import TargetTrunk

    gpus = 2
    rng = np.random.default_rng(1)
    jobs = [pad_sequences([(rng.integers(0, s.target.vocab, n), np.ones(n, np.uint8)) for n in lengths])
            for lengths in s.jobs[:jobs_used]]
    tokens = sum(int(lengths.sum()) for _, _, lengths in jobs)

    def prefill() -> tuple[float, list[torch.Tensor]]:
        trunk, packed = TargetTrunk(model, s.layer_ids), use_packing(model, s.device)
        with torch.inference_mode():
            run_target(trunk, jobs[0][0], jobs[0][2], s.device, packed)  # warm-up
            for i in range(gpus):
                torch.cuda.synchronize(i)
            t0 = time.perf_counter()
            feats = [run_target(trunk, ids, lengths, s.device, packed) for ids, _, lengths in jobs]
            for i in range(gpus):
                torch.cuda.synchronize(i)
        trunk.remove()
        return time.perf_counter() - t0, feats

    one_s, one = prefill()
    per_gpu = min(torch.cuda.get_device_properties(i).total_memory for i in range(2))
    plan = plan_target_map(model.config, 2, int(per_gpu * TARGET_WEIGHT_SHARE), s.dtype)
    model = dispatch_model(model, device_map=plan)
    two_s, two = prefill()
    same = all(a.device == b.device and torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)
               for a, b in zip(one, two))
    layers_on_1 = sum(1 for k, v in plan.items() if ".layers." in k and v == 1)
    kv = {"tok_s_1gpu": f"{tokens / one_s:.0f}", "tok_s_2gpu": f"{tokens / two_s:.0f}", "layers_on_gpu1": layers_on_1,
          "equal_features": int(same)}
    return ("pass" if same else "fail"), kv, model
