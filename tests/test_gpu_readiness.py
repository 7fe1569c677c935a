"""What a first GPU run needs, checked on CPU (issue 23): config refusals and kernel choices."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from app.config.checks import TargetInfo, check_target, read_target_info
from app.config.errors import ConfigError
from app.config.load import load_config
from tests.helpers import ROOT

INFO = TargetInfo(num_layers=6, vocab_size=512, hidden_size=64, pad_token_id=0, eos_token_ids=(2,), mask_token_id=3,
                  head_dim=8)


def test_a_head_dim_below_16_is_refused_on_cuda_in_one_line():
    """Item 2: compiled flex_attention on CUDA refuses head_dim < 16; the run says so before any actor."""
    on_gpu = load_config(ROOT / "conf/tiny.yaml", ["topology.device=cuda", "topology.gpus_per_drafter=1"])
    with pytest.raises(ConfigError) as e:
        check_target(on_gpu, INFO)
    msg = str(e.value)
    assert "\n" not in msg and "head_dim=8" in msg and ">= 16" in msg and "topology.device=cpu" in msg
    check_target(on_gpu, replace(INFO, head_dim=16))  # 16 is fine
    check_target(load_config(ROOT / "conf/tiny.yaml", []), INFO)  # CPU: the tiled kernel takes any width


def test_head_dim_is_read_from_the_target_folder(tmp_path):
    cfg = {"num_hidden_layers": 2, "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert read_target_info(tmp_path).head_dim == 8  # hidden // heads when head_dim is absent
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"head_dim": 128}))
    assert read_target_info(tmp_path).head_dim == 128


def _fake_flash_attn(root: Path, body: str) -> None:
    pkg = root / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(body)


def test_a_flash_attn_that_does_not_load_falls_back_to_sdpa_with_one_warning(tmp_path, monkeypatch):
    """Item 4: a wheel built for another torch passes `find_spec` but fails at import (its extension)."""
    import sys
    import warnings

    import torch

    from app import devices

    _fake_flash_attn(tmp_path, "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice')")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    devices.flash_attn_usable.cache_clear()
    cuda = torch.device("cuda", 0)  # a descriptor only: nothing here touches a GPU
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        picks = [devices.target_attention(cuda, torch.bfloat16) for _ in range(3)]
    devices.flash_attn_usable.cache_clear()
    assert picks == ["sdpa"] * 3
    assert len(seen) == 1 and "does not load" in str(seen[0].message) and "undefined symbol" in str(seen[0].message)


def test_a_flash_attn_that_imports_is_used_on_cuda_in_half_precision_only(tmp_path, monkeypatch):
    import sys

    import torch

    from app import devices

    _fake_flash_attn(tmp_path, "")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    devices.flash_attn_usable.cache_clear()
    try:
        assert devices.target_attention(torch.device("cuda", 0), torch.bfloat16) == "flash_attention_2"
        assert devices.target_attention(torch.device("cuda", 0), torch.float32) == "sdpa"
        assert devices.target_attention(torch.device("cpu"), torch.bfloat16) == "sdpa"
    finally:
        devices.flash_attn_usable.cache_clear()
        sys.modules.pop("flash_attn", None)


def test_targets_load_straight_onto_the_gpu_in_their_dtype(monkeypatch):
    """Item 9: without a device map each target held the whole model in host RAM before `.to(cuda)`."""
    import warnings

    import torch
    import transformers.utils

    from app import devices

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(transformers.utils, "is_accelerate_available", lambda: True)
    kw = devices.target_load_kwargs(cuda, torch.bfloat16)
    assert kw["device_map"] == {"": cuda} and kw["dtype"] is torch.bfloat16 and kw["attn_implementation"] == "sdpa"
    assert "device_map" not in devices.target_load_kwargs(torch.device("cpu"), torch.float32)
    monkeypatch.setattr(transformers.utils, "is_accelerate_available", lambda: False)
    devices.warn_no_accelerate.cache_clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        kws = [devices.target_load_kwargs(cuda, torch.bfloat16) for _ in range(2)]
    assert all("device_map" not in k for k in kws)  # transformers refuses a device map without accelerate
    assert len(seen) == 1 and "pip install accelerate" in str(seen[0].message)


def test_the_load_arguments_load_a_saved_target_on_cpu(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from app.devices import target_load_kwargs
    from tests.toy import save_tiny_target

    save_tiny_target(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, **target_load_kwargs(torch.device("cpu"), torch.float32))
    assert next(model.parameters()).dtype == torch.float32 and model.config._attn_implementation == "sdpa"


def test_the_stager_makes_every_device_tensor_on_its_side_stream(monkeypatch):
    """Item 8, rehearsed on CPU with a stand-in stream: every copy and dtype conversion of a staged batch
    runs inside the side-stream context, before its event (the loss mask's `.float()` ran outside it, on
    the prefetch thread's stream, which does not wait for the copy, and its uint8 source was freed
    without record_stream). The values equal the plain conversion."""
    import contextlib

    import numpy as np
    import torch

    from app.messages import HiddenBatch
    from app.model.loss import TrainBatch
    from app.payload.staging import PayloadStager

    state = {"inside": False, "outside_ops": [], "recorded_inside": None}

    @contextlib.contextmanager
    def stream(_):
        state["inside"] = True
        yield
        state["inside"] = False

    class Event:
        def record(self, _stream):
            state["recorded_inside"] = state["inside"]

        def synchronize(self):
            pass

    stager = PayloadStager(torch.device("cpu"), torch.float32, side_stream=object())  # the CUDA path, stand-ins
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    for name in ("to", "float", "long", "view"):
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _real=real, _name=name, **kw):
            if not state["inside"]:
                state["outside_ops"].append(_name)
            return _real(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, spy)
    h = np.random.default_rng(0).standard_normal((2, 6, 4)).astype(np.float32)
    hb = HiddenBatch(job_id=1, hidden_BSD=h, hidden_dtype="float32", input_ids_BS=np.arange(12).reshape(2, 6),
                     loss_mask_BS=np.ones((2, 6), np.uint8), lengths_B=np.array([6, 4]))
    staged = stager.stage(hb)
    state["inside"] = True  # the reference conversion below is not under test
    plain = TrainBatch.from_hidden_batch(hb, torch.device("cpu"), torch.float32)
    monkeypatch.undo()
    assert [n for n in state["outside_ops"] if n != "view"] == [] and state["recorded_inside"] is True
    for name in ("hidden_BSD", "input_ids_BS", "loss_mask_BS", "lengths_B"):
        x, y = getattr(staged, name), getattr(plain, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


def test_the_optimizer_step_holds_one_copy_of_the_gradients():
    """Item 10: at the optimizer step the old gradients stayed alive beside the flat all-reduce buffer and
    its scaled copy. Now they are freed once flattened and the flat buffer, scaled in place, is the grads."""
    import gc
    import weakref

    import torch

    from app.config.drafter_sections import DrafterConfig, TrainConfig
    from app.training.trainer import DrafterTrainer
    from tests.toy import TOY_BLOCK, toy_drafter_parts

    drafter, head, batch, _ = toy_drafter_parts()
    dcfg = DrafterConfig(block_size=TOY_BLOCK, num_anchors=7, mask_token_id=3)
    trainer = DrafterTrainer(drafter, head, dcfg, TrainConfig(compile="off"), total_steps=10, device=torch.device("cpu"))
    trainer.micro_step(batch, job_id=1)
    old = [weakref.ref(p.grad) for p in drafter.parameters()]
    seen = {}
    real_step = trainer.optimizer.step

    def step(*a, **kw):
        gc.collect()
        seen["old_alive"] = sum(r() is not None for r in old)
        seen["storages"] = {p.grad.untyped_storage().data_ptr() for p in drafter.parameters()}
        return real_step(*a, **kw)

    trainer.optimizer.step = step
    stats = trainer.finish_step()
    assert stats.weight_sum > 0 and stats.grad_norm > 0
    assert seen == {"old_alive": 0, "storages": seen["storages"]} and len(seen["storages"]) == 1


def test_the_memory_bench_counts_the_step_transient_and_the_staged_payloads():
    """Item 10: the bench left out AdamW's sqrt temporary beside the grads and the two payloads on the
    device (the one trained and the one staged next)."""
    import numpy as np
    from types import SimpleNamespace

    from app.bench.compute import memory
    from tests.toy import tiny_arch, tiny_qwen3_config

    arch = tiny_arch(tiny_qwen3_config(hidden=32, vocab=128), num_layers=2, target_layer_ids=(0, 2))
    fixed, step_extra = memory.fixed_bytes(arch)
    from app.model.drafter import DFlashDrafter

    P = sum(p.numel() for p in DFlashDrafter(arch).parameters())
    assert fixed == 16 * P + 2 * 2 * 128 * 32 and step_extra == 4 * P
    job = SimpleNamespace(lengths=np.array([10, 7]))
    assert memory.payload_bytes(arch, job) == 2 * 10 * (arch.feature_dim * 2 + 8 + 4) + 2 * 8
