"""A target spread over its bundle's GPUs (issue 37, topology.gpus_per_target > 1), planned and checked on CPU:
accelerate's planner places each decoder layer whole on one GPU, balanced, the embedding on GPU 0; a model
loaded through that map (every GPU stood in for by the CPU) gives the single-device features and logits."""
from __future__ import annotations

import pytest
import torch

from app.devices import load_target, plan_target_map, spread_over_gpus, target_load_kwargs
from app.model.target_trunk import TargetTrunk
from tests.toy import save_tiny_target, tiny_qwen3_config

LAYERS = 6


def _sizes(dtype=torch.bfloat16) -> tuple[object, int]:
    """(config, weight bytes) of the tiny target."""
    from accelerate import init_empty_weights
    from accelerate.utils import compute_module_sizes
    from transformers import AutoModelForCausalLM

    cfg = tiny_qwen3_config(hidden=64, layers=LAYERS, vocab=512)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return cfg, compute_module_sizes(model, dtype=dtype)[""]


def _layer_gpus(plan: dict) -> list[int]:
    return [plan[f"model.layers.{i}"] for i in range(LAYERS)]


def test_two_gpus_get_the_layers_split_whole_and_in_order() -> None:
    cfg, total = _sizes()
    plan = plan_target_map(cfg, 2, total, torch.bfloat16)  # either GPU could hold it all: balanced anyway
    gpus = _layer_gpus(plan)
    assert set(plan.values()) == {0, 1} and plan["model.embed_tokens"] == 0 and plan["lm_head"] == 1
    assert gpus == sorted(gpus) and 2 <= gpus.count(0) <= 4  # contiguous, and neither GPU gets them all
    assert all(not k.startswith("model.layers.") or k.count(".") == 2 for k in plan)  # no layer cut in pieces


def test_a_tied_lm_head_stays_with_the_embedding() -> None:
    """Small Qwen3s tie the head to the embedding: one weight, so one GPU runs both."""
    cfg = tiny_qwen3_config(hidden=64, layers=LAYERS, vocab=512, tie=True)
    _, total = _sizes()
    plan = plan_target_map(cfg, 2, total, torch.bfloat16)
    assert plan["lm_head"] == plan["model.embed_tokens"] == 0 and set(_layer_gpus(plan)) == {0, 1}


def test_one_gpu_holds_all_and_too_little_memory_is_one_line_naming_the_fix() -> None:
    cfg, total = _sizes()
    assert set(plan_target_map(cfg, 1, total, torch.bfloat16).values()) == {0}
    with pytest.raises(ValueError, match=r"do not fit topology.gpus_per_target=2 GPUs .* raise topology.gpus_per_target"):
        plan_target_map(cfg, 2, total // 3, torch.bfloat16)


def test_a_bundle_of_two_gpus_loads_with_the_plan_one_gpu_with_its_device(tmp_path) -> None:
    save_tiny_target(tmp_path, hidden=64, layers=LAYERS, vocab=512)
    cuda = torch.device("cuda", 0)  # only the arguments are built: no GPU needed
    _, total = _sizes()
    kw = target_load_kwargs(cuda, torch.bfloat16, str(tmp_path), num_gpus=2, gpu_bytes=total)
    assert set(kw["device_map"].values()) == {0, 1} and kw["device_map"]["model.embed_tokens"] == 0
    assert target_load_kwargs(cuda, torch.bfloat16, str(tmp_path), num_gpus=1)["device_map"] == {"": cuda}


def test_a_forward_through_the_map_equals_the_single_device_one(tmp_path) -> None:
    """The plan's module names cover the model as from_pretrained needs them, and the dispatched model (its
    accelerate hooks in place) computes the same features and logits as the plain one."""
    from transformers import AutoModelForCausalLM

    save_tiny_target(tmp_path, hidden=64, layers=LAYERS, vocab=512)
    cfg, total = _sizes(torch.float32)
    plan = plan_target_map(cfg, 2, total, torch.float32)
    plain = load_target(str(tmp_path), torch.device("cpu"), torch.float32)
    mapped = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                  device_map={k: "cpu" for k in plan}).eval()
    names = [n for n, _ in plain.named_parameters()]
    assert all(any(n == k or n.startswith(k + ".") for k in plan) for n in names)  # the map covers every weight
    assert not spread_over_gpus(plain) and not spread_over_gpus(mapped)  # one device in fact: the CPU
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for layer_ids in ([1, 3], [2, LAYERS - 1]):
            a, b = TargetTrunk(plain, layer_ids), TargetTrunk(mapped, layer_ids)
            torch.testing.assert_close(b.features(ids), a.features(ids), rtol=0, atol=0)
            a.remove(), b.remove()
        torch.testing.assert_close(mapped(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=0, atol=0)
