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


def target_load_kwargs(device: torch.device, dtype: torch.dtype, model_dir: str | None = None, num_gpus: int = 1,
                       gpu_bytes: int | None = None) -> dict:
    """`from_pretrained` arguments that load the target straight onto its device in its dtype: without a
    device map every target first holds the whole model in host RAM (5 targets x 16 GB at 8B). With
    `num_gpus` > 1 (a bundle of topology.gpus_per_target GPUs) the layers are spread over them
    (`plan_target_map`; `gpu_bytes`: the smallest GPU's memory, read from CUDA when None)."""
    from transformers.utils import is_accelerate_available

    kw = {"dtype": dtype, "attn_implementation": target_attention(device, dtype)}
    if device.type == "cuda":
        if is_accelerate_available():  # transformers needs accelerate for any device map
            kw["device_map"] = {"": device}
            if num_gpus > 1 and model_dir is not None:
                from transformers import AutoConfig

                per_gpu = gpu_bytes if gpu_bytes is not None else min(
                    torch.cuda.get_device_properties(i).total_memory for i in range(num_gpus))
                kw["device_map"] = plan_target_map(AutoConfig.from_pretrained(model_dir), num_gpus,
                                                   int(per_gpu * TARGET_WEIGHT_SHARE), dtype)
        else:
            warn_no_accelerate()
    return kw


# Of each GPU a spread target sits on, the share its weights may take; the rest holds a job's activations,
# its features and their staging (the packed 16K-token default job: a few GiB at 8B, more at 70B).
TARGET_WEIGHT_SHARE = 0.85


def plan_target_map(config, num_gpus: int, bytes_per_gpu: int, dtype: torch.dtype) -> dict[str, int]:
    """Module name -> GPU index (0..num_gpus-1, the actor's own visible GPUs): the target's decoder layers
    spread over its bundle's GPUs by accelerate's planner (weights counted on an empty-weights copy of the
    model, no download, no memory), balanced across the GPUs, each decoder layer whole on one GPU. The
    embedding lands on GPU 0, where the job's ids, the features and the payload are (TargetTrunk gathers
    every requested layer's hidden state there). Raises ValueError when the weights do not fit."""
    from accelerate import init_empty_weights, infer_auto_device_map
    from accelerate.utils import compute_module_sizes, get_balanced_memory
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    limits = {i: int(bytes_per_gpu) for i in range(num_gpus)}
    total = compute_module_sizes(model, dtype=dtype)[""]
    if total > bytes_per_gpu * num_gpus:
        gib = 2**30
        raise ValueError(f"the target's weights ({total / gib:.1f} GiB in {dtype}) do not fit topology.gpus_per_target="
                         f"{num_gpus} GPUs at {bytes_per_gpu / gib:.1f} GiB each for weights "
                         f"({TARGET_WEIGHT_SHARE:.0%} of a GPU); raise topology.gpus_per_target")
    if num_gpus > 1:
        limits = get_balanced_memory(model, max_memory=limits, no_split_module_classes=no_split, dtype=dtype)
    plan = dict(infer_auto_device_map(model, max_memory=limits, no_split_module_classes=no_split, dtype=dtype))
    assert all(isinstance(v, int) for v in plan.values()), f"a module was left off the GPUs: {plan}"
    return _tied_head_with_embedding(model, plan)


def _tied_head_with_embedding(model, plan: dict[str, int]) -> dict[str, int]:
    """A tied LM head shares the embedding's weight, which lives on one GPU: the head runs there (the planner
    does not see the tie on an empty-weights model and may put the head on the last GPU)."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(text, "tie_word_embeddings", False):
        return plan
    names = {id(m): n for n, m in model.named_modules()}
    embed, head = names.get(id(model.get_input_embeddings())), names.get(id(model.get_output_embeddings()))
    if embed in plan and head in plan:
        plan[head] = plan[embed]
    return plan


def spread_over_gpus(model) -> bool:
    """Whether `model` was loaded over more than one device (an accelerate device map)."""
    return len(set(getattr(model, "hf_device_map", {}).values())) > 1


def load_target(model_dir: str, device: torch.device, dtype: torch.dtype):
    """The frozen target in eval mode: on `device`, or spread over every GPU this actor sees (its bundle's
    topology.gpus_per_target GPUs: Ray sets CUDA_VISIBLE_DEVICES to them) when there are several."""
    from transformers import AutoModelForCausalLM

    gpus = torch.cuda.device_count() if device.type == "cuda" else 1
    model = AutoModelForCausalLM.from_pretrained(model_dir, **target_load_kwargs(device, dtype, model_dir, gpus))
    if not spread_over_gpus(model):  # a dispatched model must not be moved (its hooks place each layer)
        model = model.to(device)
    return model.eval()


@functools.cache
def warn_no_accelerate() -> None:
    """Once per process: a CUDA target without accelerate loads through host RAM."""
    warnings.warn("accelerate is not installed: each target loads its model into host RAM before moving it to "
                  "the GPU (pip install accelerate to load straight onto the device)", RuntimeWarning)
