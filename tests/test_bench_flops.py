"""The flops bench: its analytic count against torch's flop counter, its memory tracker, its RESULT line."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from app.bench.compute.flops import LiveBytes, Shape, meta_target, peak_bytes, target_flops
from app.model.features import target_features
from app.model.target_trunk import TargetTrunk

LENGTHS = [12, 7, 5]
LAYERS = [1, 2]


def _small():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64, attn_implementation="sdpa",
                      tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).eval()


def _counted(fn) -> int:
    """Flops torch counts. The math SDPA backend: torch's counter skips CPU's fused SDPA kernel, while the
    math backend computes attention as two bmm's it does count (the same pairs a padded GPU kernel runs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc, torch.inference_mode():
        fn()
    return fc.get_total_flops()


@pytest.mark.parametrize("path", ["old", "padded"])
def test_analytic_target_flops_match_torch_flop_counter(path):
    model = _small()
    shape = Shape.of(model.config)
    S = max(LENGTHS)
    ids = torch.randint(1, 101, (len(LENGTHS), S))
    attn = (torch.arange(S)[None] < torch.tensor(LENGTHS)[:, None]).long()
    if path == "old":
        counted = _counted(lambda: target_features(model, ids, attn, LAYERS))
    else:
        trunk = TargetTrunk(model, LAYERS)
        counted = _counted(lambda: trunk.features(ids, attn))
    assert counted == target_flops(shape, LENGTHS, path, LAYERS)


def test_needed_and_packed_counts_differ_only_by_tile_rounding():
    shape = Shape()
    lengths = [3072, 1000, 129]
    needed, packed = target_flops(shape, lengths, "needed"), target_flops(shape, lengths, "packed")
    pairs_needed = sum(n * (n + 1) // 2 for n in lengths)
    pairs_tiled = sum((m := -(-n // 128)) * (m + 1) // 2 * 128 * 128 for n in lengths)
    assert packed - needed == 34 * (pairs_tiled - pairs_needed) * shape.attention_per_pair()
    # The old path pays two more layers, the LM head and the padded square on top.
    assert target_flops(shape, lengths, "old") > 1.2 * needed


def test_live_bytes_tracks_the_peak_of_live_storages():
    with LiveBytes() as mem:
        a = torch.empty(1000, device="meta")  # 4,000 bytes
        b = torch.empty(500, device="meta")  # 2,000 bytes
        del a
        c = torch.empty(250, device="meta")  # 1,000 bytes (a is gone by now)
        v = c.view(25, 10)  # a view: no new storage
    assert mem.peak == 6000 and mem.current == 3000
    del b, c, v


def test_truncated_target_peaks_far_below_the_full_path_on_meta():
    shape = Shape(hidden=256, intermediate=512, layers=36, heads=4, kv_heads=2, head_dim=64, vocab=8192)
    model = meta_target(shape)
    job = [300, 200, 100]
    old, new = peak_bytes(model, job, "old"), peak_bytes(model, job, "new")
    logits = 3 * 300 * 8192 * 2  # bf16 [B, S, V]: the full path holds them
    assert old > logits and new < 0.35 * old


@pytest.mark.slow
def test_flops_bench_prints_a_result_line(capsys):
    from app.bench.compute.flops import main

    assert main([]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("RESULT target_flops_ratio=") and "target_peak_vs_full=" in line
    vals = dict(kv.split("=") for kv in line.split()[1:])
    assert float(vals["target_flops_ratio"]) <= 1.02 and float(vals["target_peak_vs_full"]) <= 0.35
    assert float(vals["target_flops_ratio_old"]) > 1.1
