"""Device and dtype choice from config (tests fake GPUs, so torch's own view decides nothing alone)."""
from __future__ import annotations

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def pick_device(setting: str) -> torch.device:
    """`topology.device`: auto = cuda when this process sees one; cuda insists; cpu is cpu."""
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("topology.device=cuda but this actor sees no CUDA device (check gpus_per_* and drivers)")
        return torch.device("cuda", 0)  # Ray sets CUDA_VISIBLE_DEVICES to the actor's own GPU
    return torch.device("cpu")


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """The configured dtype on GPU; float32 on CPU, where bf16 matmuls are slow and lossy."""
    return _DTYPES[name] if device.type == "cuda" else torch.float32


def limit_threads(num_cpus: float) -> int:
    """Cap torch's intra-op threads to this actor's CPU share, so 8 actors do not fight over 2 cores."""
    n = max(1, int(num_cpus))
    torch.set_num_threads(n)
    return n
