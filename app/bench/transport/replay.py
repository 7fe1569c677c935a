"""`python -m app.bench replay`: what replaying a job's features costs against the target forward it saves.

Per shape (the tiny target of conf/tiny.yaml and SmolLM2-135M of conf/smol.yaml), side by side in one run:
- target: seconds per job of the forward the TargetActor runs (`app.data.target_forward.job_hidden_batch` through
  a `TargetTrunk`, up to the deepest feature layer), on a randomly initialised model of the target's exact
  shape (the real weights are not loaded: the arithmetic is the same), one torch thread as a CPU target has;
- write: seconds per job of `keep_job` into a fresh local store (each sequence checked-summed and linked
  into place), on the forward's own batch;
- read: seconds per job of `replay_job` (every entry read and checked, the padded batch assembled) of a
  job of the next epoch's grouping: first off the disk (the files flushed and dropped from the page cache
  with posix_fadvise), then again from the page cache.

Replay pays when the read off the disk takes less than the forward: each later epoch (or run) saves
target_s - read_s per job; `target_over_read` is target_s over the cold read. The write
runs on the target's writer thread beside the next forward, so it costs the target nothing while
write_s < target_s. `python -m app.bench replay [--repeats N] [--folder DIR]`.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.bench.common import ROOT, print_result

# SmolLM2-135M-Instruct's shape (its config.json), for a model built without its weights.
SMOL_SHAPE = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                  intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
                  rope_theta=100000.0, max_position_embeddings=8192)


@dataclass(frozen=True)
class Shape:
    """One target's job as a config makes it: the model's shape, its feature layers and the job's sequences."""

    name: str
    model: object  # a randomly initialised HF causal LM of the target's shape
    layer_ids: list[int]
    seq_len: int
    seqs_per_job: int


def shapes() -> list[Shape]:
    """The tiny target (conf/tiny.yaml) and SmolLM2 (conf/smol.yaml)."""
    return [tiny_shape(), smol_shape()]


def tiny_shape() -> Shape:
    """conf/tiny.yaml's target: its tiny section's sizes, its default feature layers, its job size."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from app.config.drafter_sections import resolve_layer_ids
    from app.config.load import load_config

    torch.manual_seed(0)
    cfg = load_config(ROOT / "conf/tiny.yaml", [])
    t = cfg.tiny
    model = Qwen3ForCausalLM(Qwen3Config(
        hidden_size=t.hidden_size, num_hidden_layers=t.num_layers, num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_kv_heads, head_dim=t.hidden_size // t.num_heads,
        intermediate_size=t.intermediate_size, vocab_size=t.vocab_size)).eval()
    layers = resolve_layer_ids(cfg.model.target_layer_ids, t.num_layers, cfg.drafter.num_layers)
    return _shape("tiny", model, layers, cfg.data)


def smol_shape() -> Shape:
    """SmolLM2-135M's shape with conf/smol.yaml's feature layers and job size (nothing is loaded)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.config.load import load_config

    torch.manual_seed(0)
    cfg = load_config(ROOT / "conf/smol.yaml", ["model.target=tiny"])  # the sizes only
    layers = list(cfg.model.target_layer_ids)
    # Layers past the deepest feature layer never run (TargetTrunk stops there): not built either.
    model = LlamaForCausalLM(LlamaConfig(**{**SMOL_SHAPE, "num_hidden_layers": max(layers) + 1})).eval()
    return _shape("smol", model, layers, cfg.data)


def _shape(name: str, model, layers: list[int], data) -> Shape:
    seq_len = data.max_length // 2  # a middle bucket's sequences, tokens_per_job of them padded
    return Shape(name, model, layers, seq_len, max(1, data.tokens_per_job // seq_len))


def _jobs(shape: Shape, vocab: int, rng: np.random.Generator) -> tuple[list, list]:
    """Two jobs of one epoch and one job of the next, regrouping the first two's sequences."""
    seqs = [(rng.integers(10, vocab, shape.seq_len - (i % 3)).astype(np.int32),
             np.ones(shape.seq_len - (i % 3), np.uint8)) for i in range(2 * shape.seqs_per_job)]
    first = [seqs[:shape.seqs_per_job], seqs[shape.seqs_per_job:]]
    regrouped = seqs[::2]  # half of each first-epoch job
    return first, [regrouped]


def measure(shape: Shape, folder: Path, repeats: int) -> dict:
    """target_s, write_s and read_s per job (the fastest of `repeats`), and the payload's megabytes."""
    import torch

    from app.data.target_forward import job_hidden_batch
    from app.model.target_trunk import TargetTrunk
    from app.replay.backend import LocalFolder
    from app.replay.jobs import keep_job, replay_job
    from app.replay.key import ReplayKey, payload_dtype
    from app.replay.store import ReplayStore

    torch.set_num_threads(1)
    trunk = TargetTrunk(shape.model, shape.layer_ids)
    first, second = _jobs(shape, shape.model.config.vocab_size, np.random.default_rng(0))
    target_s, write_s, read_s, cold_s, nbytes = [], [], [], [], 0
    for r in range(repeats):
        key = ReplayKey(f"bench-{r}", tuple(shape.layer_ids), payload_dtype("bfloat16", torch.float32))
        store = ReplayStore(LocalFolder(folder / f"{shape.name}-{r}"), key, 1 << 40, log=lambda _: None)
        for j, seqs in enumerate(first):
            t0 = time.perf_counter()
            batch = job_hidden_batch(trunk, seqs, j, shape.layer_ids, torch.device("cpu"))
            t1 = time.perf_counter()
            keep_job(store, batch)
            t2 = time.perf_counter()
            target_s.append(t1 - t0)
            write_s.append(t2 - t1)
            nbytes = max(nbytes, batch.hidden_BSD.nbytes)
        evict_from_page_cache(folder / f"{shape.name}-{r}")
        for j, seqs in enumerate(second):
            for reads in (cold_s, read_s):  # off the disk, then again from the page cache
                t0 = time.perf_counter()
                got = replay_job(store, 100 + j, seqs)
                reads.append(time.perf_counter() - t0)
                assert got is not None, "a regrouped job of stored sequences must be served from the store"
    return {"target_s": min(target_s), "write_s": min(write_s), "read_s": min(read_s), "cold_s": min(cold_s),
            "payload_mb": nbytes / 1e6}


def evict_from_page_cache(folder: Path) -> None:
    """Flush the store's files and ask the kernel to drop their cached pages (no root needed for clean pages),
    so the next read comes off the disk."""
    import os

    for path in folder.rglob("*.feat"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.bench replay", description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="runs of each measurement; the fastest counts")
    ap.add_argument("--folder", default=None, help="where the stores are written (default: a temporary folder)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.folder) as tmp:
        for shape in shapes():
            m = measure(shape, Path(tmp), max(1, args.repeats))
            print(f"{shape.name}: job of {shape.seqs_per_job} x {shape.seq_len} tokens, layers {shape.layer_ids}, "
                  f"{m['payload_mb']:.1f} MB of features: target {m['target_s'] * 1e3:.1f} ms, "
                  f"write {m['write_s'] * 1e3:.1f} ms, read {m['cold_s'] * 1e3:.1f} ms off the disk and "
                  f"{m['read_s'] * 1e3:.1f} ms from the page cache per job", flush=True)
            print_result({"bench": "replay", "shape": shape.name, "seqs": shape.seqs_per_job, "seq_len": shape.seq_len,
                          "layers": len(shape.layer_ids), "payload_mb": m["payload_mb"], "target_ms": m["target_s"] * 1e3,
                          "write_ms": m["write_s"] * 1e3, "read_cold_ms": m["cold_s"] * 1e3, "read_ms": m["read_s"] * 1e3,
                          "target_over_read": m["target_s"] / m["cold_s"], "pays": m["cold_s"] < m["target_s"]}, digits=2)
    return 0
