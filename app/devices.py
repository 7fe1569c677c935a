"""Device and dtype choice from config (tests fake GPUs, so torch's own view decides nothing alone)."""
from __future__ import annotations

import functools
import warnings

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


def target_attention(device: torch.device, dtype: torch.dtype) -> str:
    """flash_attention_2 on CUDA in bf16/fp16 when flash-attn really imports (packed varlen jobs), else sdpa."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and flash_attn_usable():
        return "flash_attention_2"
    return "sdpa"


@functools.cache
def flash_attn_usable() -> bool:
    """Imports flash-attn for real, once per process: a wheel built for another torch or CUDA is found by
    `find_spec` but fails to load its extension, which would fail every target job at the first forward."""
    try:
        import flash_attn  # noqa: F401  (its __init__ loads the CUDA extension)
    except ModuleNotFoundError:
        return False
    except (ImportError, OSError, RuntimeError) as e:  # undefined symbol, missing libcudart, ABI check
        warnings.warn(f"flash-attn is installed but does not load ({type(e).__name__}: {str(e)[:200]}); "
                      "the targets use SDPA (padded jobs). Reinstall flash-attn built for this torch", RuntimeWarning)
        return False
    return True


def target_load_kwargs(device: torch.device, dtype: torch.dtype) -> dict:
    """`from_pretrained` arguments that load the target straight onto its device in its dtype: without a
    device map every target first holds the whole model in host RAM (5 targets x 16 GB at 8B)."""
    from transformers.utils import is_accelerate_available

    kw = {"dtype": dtype, "attn_implementation": target_attention(device, dtype)}
    if device.type == "cuda":
        if is_accelerate_available():  # transformers needs accelerate for any device map
            kw["device_map"] = {"": device}
        else:
            warn_no_accelerate()
    return kw


@functools.cache
def warn_no_accelerate() -> None:
    """Once per process: a CUDA target without accelerate loads through host RAM."""
    warnings.warn("accelerate is not installed: each target loads its model into host RAM before moving it to "
                  "the GPU (pip install accelerate to load straight onto the device)", RuntimeWarning)
