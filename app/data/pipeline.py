"""Training data for a run: from the cache when it holds these inputs, else tokenized and cached.

    files ─► cache key (files' path/size/mtime, tokenizer, data settings) ─► hit: memory-map the entry
                                                                          └► miss: tokenize ─► write entry
    tokenize: one process (`load_dataset`, the reference; small inputs, data.num_workers=1)
              or a Ray Data pipeline: files cut into shards of ~2K records (shards.py), each shard
              tokenized by one of `num_workers` actors holding the tokenizer, results put back in shard
              order, so the dataset, the per-file summary and the first malformed record's file:line
              are exactly the single-process ones.
"""
from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from app.config.schema import Config, DataConfig
from app.data import cache
from app.data.dataset import ShardResult, TokenizedDataset, assemble, load_dataset, tokenize_shard
from app.data.progress import progress_bar
from app.data.records import DataError
from app.data.shards import Shard, plan_shards

RECORDS_PER_SHARD = 2048
# Below this much input, one process finishes before a Ray Data pipeline has started its workers.
PARALLEL_MIN_BYTES = 32 << 20


def load_or_tokenize(cfg: Config, model_dir: str, tokenizer, files: list[str], *,
                     spare_cpus: Callable[[], float] | None = None, progress: bool = True,
                     log: Callable[[str], None] = print, vocab_size: int = 0) -> TokenizedDataset:
    """The tokenized data of `files`: memory-mapped from `data.cache_dir` when an entry matches, else
    tokenized (in parallel where it pays) and written there. `spare_cpus` connects to the cluster and
    says how many CPUs it has left for tokenizing (used when data.num_workers is 0 = auto). `vocab_size`
    is the target's: pre-tokenized ids at or above it are malformed records (0 = unchecked, for
    tokenizer-only folders in tests and benches)."""
    if not files:
        raise DataError("no training files; set data.train_files (or use model.target=tiny)")
    root = cache.cache_root(cfg)
    key, parts = data_cache_key(cfg, model_dir, tokenizer, files, vocab_size)
    t0 = time.perf_counter()
    dataset = cache.load(root, key)
    if dataset is not None:
        log(f"data: loaded {len(dataset)} tokenized sequences from the cache {root / key} "
            f"({time.perf_counter() - t0:.2f} s)")
        return dataset
    workers = resolve_workers(cfg.data, files, spare_cpus)
    dataset = tokenize_files(cfg.data, cfg.drafter.block_size, model_dir, tokenizer, files, workers, progress,
                             vocab_size)
    took = time.perf_counter() - t0
    entry = cache.save(root, key, dataset, parts)
    log(f"data: tokenized {dataset.summary.total().records} records with "
        f"{'1 process' if workers <= 1 else f'{workers} Ray Data workers'} in {took:.1f} s; cached in {entry}")
    for line in summary_lines(dataset):
        log(f"data:   {line}")
    return dataset


def data_cache_key(cfg: Config, model_dir: str, tokenizer, files: list[str],
                   vocab_size: int = 0) -> tuple[str, dict]:
    """(key, what it hashes) of the cache entry `load_or_tokenize` reads and writes for these inputs."""
    return cache.cache_key(files, f"{cache.tokenizer_fingerprint(model_dir, tokenizer)}:vocab{vocab_size}",
                           cfg.data, cfg.drafter.block_size)


def summary_lines(dataset: TokenizedDataset) -> list[str]:
    """One line per input file: records, kept, dropped by reason, truncated, tokens."""
    out = []
    for path, fs in dataset.summary.files.items():
        dropped = ", ".join(f"{k} {v}" for k, v in fs.dropped.items() if v) or "none"
        out.append(f"{path}: {fs.records} records, {fs.kept} kept, dropped: {dropped}; {fs.truncated} truncated, "
                   f"{fs.tokens} tokens")
    return out


def resolve_workers(data: DataConfig, files: list[str], spare_cpus: Callable[[], float] | None) -> int:
    """data.num_workers, or for 0 (auto): 1 for small inputs, else the CPUs the cluster has left."""
    if data.num_workers > 0:
        return data.num_workers
    if sum(Path(f).stat().st_size for f in files) < PARALLEL_MIN_BYTES:
        return 1
    cpus = spare_cpus() if spare_cpus is not None else float(os.cpu_count() or 1)
    return max(1, int(cpus))


def tokenize_files(data: DataConfig, block_size: int, model_dir: str, tokenizer, files: list[str],
                   workers: int, progress: bool = True, vocab_size: int = 0) -> TokenizedDataset:
    """Tokenize `files` in this process (workers <= 1) or with `workers` Ray Data workers."""
    if workers <= 1:
        return load_dataset(data, block_size, tokenizer, files, progress=progress, vocab_size=vocab_size)
    shards = [s for f in files for s in plan_shards(str(f), RECORDS_PER_SHARD)]
    return assemble(files, _ray_data_results(shards, data, block_size, model_dir, workers, progress, vocab_size))


class _ShardTokenizer:
    """A Ray Data worker: loads the tokenizer once, then tokenizes the shards it is handed."""

    def __init__(self, model_dir: str, data: DataConfig, block_size: int, shards: list[Shard], vocab_size: int) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.data, self.block_size, self.shards, self.vocab_size = data, block_size, shards, vocab_size

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = [pickle.dumps(tokenize_shard(self.shards[int(i)], self.data, self.block_size, self.tokenizer,
                                           vocab_size=self.vocab_size))
               for i in batch["shard"]]
        return {"shard": np.asarray(batch["shard"]), "result": np.asarray(out, dtype=object)}


def _ray_data_results(shards: list[Shard], data: DataConfig, block_size: int, model_dir: str, workers: int,
                      progress: bool, vocab_size: int = 0) -> list[ShardResult]:
    import ray

    if not ray.is_initialized():  # RAY_ADDRESS, or a throwaway local cluster with token auth (as app.train's)
        from app.ray_cluster import init_ray

        init_ray()
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # ours counts records, theirs blocks
    ds = ray.data.from_items([{"shard": i} for i in range(len(shards))], override_num_blocks=len(shards))
    ds = ds.map_batches(_ShardTokenizer, fn_constructor_args=(model_dir, data, block_size, shards, vocab_size),
                        batch_size=1, concurrency=workers, num_cpus=1, batch_format="numpy")
    results: list[ShardResult | None] = [None] * len(shards)
    with progress_bar(sum(s.records for s in shards), f"tokenize ({workers} workers)", enabled=progress) as bar:
        for row in ds.iter_rows():
            r: ShardResult = pickle.loads(row["result"])
            results[int(row["shard"])] = r
            bar.update(shards[int(row["shard"])].records)
    # Under on_error=raise a shard stops at its first malformed record; assemble raises the first in
    # file order, which is the one the single-process path stops at.
    return [r for r in results if r is not None]
