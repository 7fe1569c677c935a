"""`python -m app.bench flops [--lengths-seed N]`: executed vs needed FLOPs at conf/default.yaml shapes, and
the target's peak memory beyond weights for one job, without a GPU or any weights.

Target: a Qwen3-8B-shaped model (36 layers, H 4096, I 12288, 32/8 heads of 128, vocab 151,936),
`target_layer_ids` [1, 9, 17, 25, 33]. The jobs are the real schedule (`app.data.schedule.bucket_jobs`,
default buckets and 16,384 tokens per job) over a synthetic length mix (log-normal, median 600, clipped
to 32..3,072; printed), so each job carries the padding a bucketed job has.

FLOPs are counted analytically (`target_flops`; matmuls and attention, 2 per multiply-add, forward);
tests/test_bench_flops.py checks the count against `torch.utils.flop_counter` on a small model.
- needed: decoder layers 0..max(layer_ids) over the real tokens, causal attention pairs s(s+1)/2;
- old path: the full CausalLM (all layers + LM head) over the padded [B, S] batch, with SDPA given a
  padding mask (every query-key pair of the padded square is computed);
- new path, CUDA with flash-attention: layers up to the deepest over the packed real tokens, varlen
  causal attention (128x128 tiles on and below the diagonal);
- new path without flash-attention (CPU, or CUDA sdpa): layers up to the deepest, padded.

Peak memory: the real code paths (`target_features` = old, `TargetTrunk` packed = new) run on meta
tensors at full size under a dispatch mode that tracks live storage bytes (weights excluded: they exist
before the mode starts). Attention is a stand-in with flash-attention's footprint (its output only) in
both paths, so neither is charged an S x S score matrix that a GPU kernel never materialises.

Drafter: `app/bench/compute/flops_drafter.py` (the drafter side's bench) is run and its
`drafter_attn_flops_ratio` is passed on.
"""
from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

import numpy as np
import torch

from app.bench.common import SHAPES_ONLY, bench_config, parse_result, print_result

LAYER_IDS = [1, 9, 17, 25, 33]
TILE = 128  # flash-attention's query/key tile: varlen causal attention computes whole tiles


@dataclass(frozen=True)
class Shape:
    """The target dimensions that decide its FLOPs."""

    hidden: int = 4096
    intermediate: int = 12288
    layers: int = 36
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 151936

    @classmethod
    def of(cls, config) -> Shape:
        return cls(config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                   config.num_attention_heads, config.num_key_value_heads,
                   getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                   config.vocab_size)

    def linear_per_token(self) -> int:
        """q, k, v, o projections and the SwiGLU MLP of one layer, per token."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * (self.hidden * q + 2 * self.hidden * kv + q * self.hidden + 3 * self.hidden * self.intermediate)

    def attention_per_pair(self) -> int:
        """QK^T and PV for one (query, key) pair of one layer, all heads."""
        return 2 * 2 * self.heads * self.head_dim


def causal_pairs(s: int) -> int:
    return s * (s + 1) // 2


def tiled_causal_pairs(s: int, tile: int = TILE) -> int:
    """Pairs a causal flash kernel computes: whole tiles on and below the diagonal."""
    n = -(-s // tile)
    return n * (n + 1) // 2 * tile * tile


def target_flops(shape: Shape, lengths: list[int], path: str, layer_ids=LAYER_IDS) -> int:
    """Forward FLOPs of one job of sequences `lengths` by `path`: needed | old | packed | padded."""
    S, B, real = max(lengths), len(lengths), sum(lengths)
    deep = max(layer_ids) + 1
    padded_square = B * S * S if any(n < S for n in lengths) else B * causal_pairs(S)  # no padding: is_causal
    if path == "needed":
        layers, tokens, pairs, head = deep, real, sum(causal_pairs(n) for n in lengths), 0
    elif path == "old":
        layers, tokens, pairs, head = shape.layers, B * S, padded_square, B * S
    elif path == "packed":
        layers, tokens, pairs, head = deep, real, sum(tiled_causal_pairs(n) for n in lengths), 0
    elif path == "padded":
        layers, tokens, pairs, head = deep, B * S, padded_square, 0
    else:
        raise ValueError(f"unknown path {path!r}")
    return (layers * (tokens * shape.linear_per_token() + pairs * shape.attention_per_pair())
            + head * 2 * shape.hidden * shape.vocab)


# --- jobs with real padding -------------------------------------------------------------------------------

def synthetic_lengths(n: int = 20000, seed: int = 0, max_length: int = 3072) -> np.ndarray:
    """A chat-like length mix: log-normal, median 600 tokens, clipped to [32, max_length]."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(600), 0.9, n), 32, max_length).astype(np.int64)


def default_jobs(lengths: np.ndarray) -> list[list[int]]:
    """Every job of epoch 0 under conf/default.yaml's data section, as lists of sequence lengths."""
    from app.data.schedule import bucket_jobs

    cfg = bench_config("default", SHAPES_ONLY)  # the data section only
    per_bucket = bucket_jobs(lengths, cfg.data, epoch=0)
    return [[int(lengths[i]) for i in job] for jobs in per_bucket for job in jobs]


# --- peak memory on meta tensors --------------------------------------------------------------------------

class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak bytes of storages created inside the mode and still alive (tensors made before it are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[object, int]] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef

        out = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.live:
                    nbytes = t.untyped_storage().nbytes()
                    self.live[ref.cdata] = (ref, nbytes)
                    self.current += nbytes
        self.peak = max(self.peak, self.current)
        return out


META_ATTN = "meta_footprint_attn"  # a name with "flash" in it makes HF look for a kernel


def _flash_footprint_attention(module, query, key, value, attention_mask, **kwargs):
    """Stand-in for flash-attention on meta tensors: allocates only its [B, S, heads, head_dim] output."""
    B, h, S, d = query.shape
    return query.new_empty(B, S, h, d), None


def register_meta_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(META_ATTN, _flash_footprint_attention)
    AttentionMaskInterface.register(META_ATTN, lambda *a, **k: None)


def meta_target(shape: Shape, dtype=torch.bfloat16):
    """A Qwen3 CausalLM of `shape` with meta weights (no memory), flash-footprint attention."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    register_meta_attention()
    cfg = Qwen3Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, max_position_embeddings=40960,
                      tie_word_embeddings=False, attn_implementation=META_ATTN)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg).to(dtype).eval()
    return model


def peak_bytes(model, lengths: list[int], path: str) -> int:
    """Live activation bytes at the peak of one job's target call on meta tensors: old | new."""
    from app.data.target_forward import packed_inputs, padded_rows, unpack_features
    from app.model.features import target_features
    from app.model.target_trunk import TargetTrunk

    lengths_B = np.array(lengths)
    ids_BS = np.zeros((len(lengths), max(lengths)), dtype=np.int64)
    meta = torch.device("meta")
    no_mask = {"full_attention": None}  # prepared masks: flash needs none, and meta tensors cannot be inspected
    with torch.inference_mode():
        if path == "old":
            ids = torch.from_numpy(ids_BS).to(meta)
            with LiveBytes() as mem:
                out = target_features(model, ids, no_mask, LAYER_IDS)
            del out
            return mem.peak
        trunk = TargetTrunk(model, LAYER_IDS)
        try:
            row = packed_inputs(ids_BS, lengths_B, meta)
            with LiveBytes() as mem:
                rows_T = padded_rows(ids_BS.shape, lengths_B, meta)
                feats = unpack_features(trunk.features(attention_mask_BS=no_mask, **row)[0], ids_BS.shape, rows_T)
            del feats
            return mem.peak
        finally:
            trunk.remove()


# --- the drafter side -------------------------------------------------------------------------------------

def drafter_ratio(argv: list[str]) -> tuple[str, str]:
    """(ratio, its bench's output) from app/bench/compute/flops_drafter.py, the drafter side's bench."""
    from app.bench.compute import flops_drafter

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        flops_drafter.main(argv)
    text = buf.getvalue()
    return parse_result(text)["drafter_attn_flops_ratio"], text


def main(argv: list[str]) -> int:
    shape = Shape()
    lengths = synthetic_lengths()
    jobs = default_jobs(lengths)
    print(f"target: Qwen3-8B shape {shape}, layer_ids {LAYER_IDS} (layers 0..{max(LAYER_IDS)} needed of "
          f"{shape.layers})")
    print(f"jobs: {len(jobs)} of conf/default.yaml (16,384 padded tokens at most) over {len(lengths)} synthetic "
          f"lengths (median {int(np.median(lengths))}, p90 {int(np.percentile(lengths, 90))})")
    paths = ("needed", "old", "packed", "padded")
    totals = {p: sum(target_flops(shape, j, p) for j in jobs) for p in paths}
    real = sum(map(sum, jobs))
    padded = sum(len(j) * max(j) for j in jobs)
    print(f"tokens: {real} real, {padded} padded ({padded / real - 1:.1%} padding)")
    for p in paths[1:]:
        print(f"  {p:7s} executed/needed {totals[p] / totals['needed']:.3f}  ({totals[p] / len(jobs) / 1e12:.1f} "
              f"TFLOP per job; needed {totals['needed'] / len(jobs) / 1e12:.1f})")
    # One job for memory: the one with the most padded tokens (the largest activations).
    job = max(jobs, key=lambda j: len(j) * max(j))
    one = {p: target_flops(shape, job, p) / target_flops(shape, job, "needed") for p in paths[1:]}
    print(f"one job ({len(job)} seqs, {sum(job)} real / {len(job) * max(job)} padded tokens): executed/needed "
          + ", ".join(f"{p} {r:.3f}" for p, r in one.items()))
    model = meta_target(shape)
    old_b, new_b = peak_bytes(model, job, "old"), peak_bytes(model, job, "new")
    print(f"target peak beyond weights, that job: full path {old_b / 2**30:.2f} GiB, truncated packed "
          f"{new_b / 2**30:.2f} GiB (ratio {new_b / old_b:.3f})")
    d_ratio, d_text = drafter_ratio(argv)
    print("drafter: " + d_text.strip().replace("\n", "\n  "))
    print_result({"target_flops_ratio": totals["packed"] / totals["needed"], "drafter_attn_flops_ratio": d_ratio,
                  "target_peak_vs_full": new_b / old_b, "target_flops_ratio_old": totals["old"] / totals["needed"],
                  "target_flops_ratio_padded": totals["padded"] / totals["needed"]})
    return 0
