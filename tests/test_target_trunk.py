"""Truncated target forward: the same features as the full HF path, without the work above them."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from app.data.target_forward import job_hidden_batch, packed_inputs, run_target, to_host_async, use_packing
from app.model.features import target_features
from app.model.target_trunk import TargetTrunk

LENGTHS = [13, 9, 4]


def _model(kind: str, layers: int = 5):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                  attn_implementation="sdpa")
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common)).eval()
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    assert kind == "gpt2"
    return GPT2LMHeadModel(GPT2Config(vocab_size=101, n_embd=32, n_layer=layers, n_head=4, n_positions=64)).eval()


def _padded_batch():
    g = torch.Generator().manual_seed(1)
    S = max(LENGTHS)
    ids_BS = torch.randint(1, 101, (len(LENGTHS), S), generator=g)
    attn_BS = (torch.arange(S)[None] < torch.tensor(LENGTHS)[:, None]).long()
    return ids_BS * attn_BS, attn_BS


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("layer_ids", [[0, 2, 3], [1, 4], [4, 0, 4], [2]])
def test_truncated_features_are_bit_identical_to_the_full_path(kind, layer_ids):
    model = _model(kind)
    ids_BS, attn_BS = _padded_batch()
    trunk = TargetTrunk(model, layer_ids)
    with torch.inference_mode():
        full = target_features(model, ids_BS, attn_BS, layer_ids)
        new = trunk.features(ids_BS, attn_BS)
    assert trunk.truncated and new.shape == (3, max(LENGTHS), 32 * len(layer_ids))
    assert torch.equal(new, full)  # fp32 on CPU: the very same numbers, padding positions included


def test_layers_above_the_deepest_and_the_lm_head_never_run():
    model = _model("qwen3", layers=6)
    calls: list[str] = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda *_a, i=i: calls.append(f"layer{i}"))
    model.lm_head.register_forward_hook(lambda *_a: calls.append("lm_head"))
    model.model.norm.register_forward_hook(lambda *_a: calls.append("norm"))
    ids_BS, attn_BS = _padded_batch()
    with torch.inference_mode():
        TargetTrunk(model, [1, 3]).features(ids_BS, attn_BS)
    assert calls == ["layer0", "layer1", "layer2", "layer3"]


def test_hooks_do_nothing_outside_features():
    """The tau evaluation shares the model: a plain forward must still see every layer and the logits."""
    model = _model("qwen3")
    ids_BS, attn_BS = _padded_batch()
    with torch.inference_mode():
        before = model(input_ids=ids_BS, attention_mask=attn_BS).logits
        TargetTrunk(model, [1])
        after = model(input_ids=ids_BS, attention_mask=attn_BS).logits
    assert torch.equal(before, after)


def test_unusual_layout_falls_back_to_the_full_path_with_a_warning():
    model = _model("gpt2")  # decoder layers at transformer.h, not model.layers
    ids_BS, attn_BS = _padded_batch()
    with pytest.warns(UserWarning, match="fall back to the full forward"):
        trunk = TargetTrunk(model, [0, 2])
    with torch.inference_mode():
        feats = trunk.features(ids_BS, attn_BS)
        full = target_features(model, ids_BS, attn_BS, [0, 2])
    assert not trunk.truncated and torch.equal(feats, full)


def test_layer_ids_outside_the_target_name_the_range():
    with pytest.raises(ValueError, match=r"target_layer_ids \[1, 5\] outside the target's layers 0..4"):
        TargetTrunk(_model("qwen3"), [1, 5])


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_packed_sequences_give_the_padded_features(kind):
    """One row, positions restarting per sequence (the CUDA flash-varlen layout; sdpa masks it block-diagonally
    on CPU). Same values on every real position; not bit-equal, since the matmuls see other shapes."""
    model = _model(kind)
    ids_BS, attn_BS = _padded_batch()
    lengths_B = np.array(LENGTHS)
    trunk = TargetTrunk(model, [0, 3])
    with torch.inference_mode():
        padded = run_target(trunk, ids_BS.numpy(), lengths_B, torch.device("cpu"), packed=False)
        packed = run_target(trunk, ids_BS.numpy(), lengths_B, torch.device("cpu"), packed=True)
        row = packed_inputs(ids_BS.numpy(), lengths_B, torch.device("cpu"))
        full_packed = target_features(model, row["input_ids_BS"], None, [0, 3], position_ids_BS=row["position_ids_BS"])
    for r, n in enumerate(LENGTHS):
        assert torch.allclose(packed[r, :n], padded[r, :n], atol=2e-6, rtol=1e-5)
        assert packed[r, n:].abs().sum() == 0  # past the length: zeros, which drafters never read
    # The packed trunk is bit-identical to the full HF forward on the same packed row.
    valid = attn_BS.bool()
    assert torch.equal(packed[valid], full_packed[0])


def test_job_hidden_batch_packed_and_padded_agree():
    model = _model("qwen3")
    rng = np.random.default_rng(0)
    seqs = [(rng.integers(1, 101, n), np.ones(n, np.uint8)) for n in LENGTHS]
    a = job_hidden_batch(model, seqs, 3, [1, 2], torch.device("cpu"), packed=False)
    b = job_hidden_batch(model, seqs, 3, [1, 2], torch.device("cpu"), packed=True)
    for row, n in enumerate(LENGTHS):
        assert np.allclose(a.hidden_BSD[row, :n], b.hidden_BSD[row, :n], atol=2e-6, rtol=1e-5)
    assert (a.input_ids_BS == b.input_ids_BS).all() and (a.lengths_B == b.lengths_B).all()


def test_cpu_keeps_padded_sdpa_and_the_plain_host_copy():
    model = _model("qwen3")
    assert not use_packing(model, torch.device("cpu"))
    model.config._attn_implementation = "flash_attention_2"
    assert use_packing(model, torch.device("cuda")) and not use_packing(model, torch.device("cpu"))
    x = torch.randn(2, 3)
    host, done = to_host_async(x)
    assert host is x and done is None


def test_target_concurrency_overlaps_only_on_gpu():
    from actors.target import target_concurrency

    assert target_concurrency("auto", True, 2) == 2
    assert target_concurrency("cpu", False, 2) == 1
    assert target_concurrency("auto", False, 3) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pinned_async_copy_matches_the_device_tensor():
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    host, done = to_host_async(x)
    done.synchronize()
    assert host.is_pinned() and torch.equal(host, x.cpu())


def test_overlapping_jobs_never_count_the_same_busy_second_twice():
    from actors.target import BusyClock

    clock = iter([1.0, 1.9, 3.5])  # job A ends at 1.0, job B (started 0.1, behind A) at 1.9, job C at 3.5
    busy = BusyClock(clock=lambda: next(clock))
    spans = [busy.share(0.0), busy.share(0.1), busy.share(2.5)]
    assert spans == pytest.approx([1.0, 0.9, 1.0])  # the idle gap 1.9..2.5 is not busy time
