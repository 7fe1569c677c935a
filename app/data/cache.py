"""The tokenized-data cache: a dataset written once, memory-mapped on every later run.

Layout of one entry, `<data.cache_dir>/<key>/`:
    tokens.npy     int32 [T]   every kept sequence's tokens, back to back
    loss_mask.npy  uint8 [T]
    offsets.npy    int64 [N+1] sequence i is tokens[offsets[i]:offsets[i+1]]
    summary.json   the data summary (per file: records, kept, dropped by reason, truncated, tokens)
    meta.json      what the key was made of, for people reading the folder
An entry is written into a temp folder and renamed into place, so readers never see half of one and
two runs that tokenize the same data at once both end up with one complete entry.

The key hashes the input files (absolute path and a SHA-256 of their bytes: a file rewritten with the
same size and its old modification time is other data, and must miss), the tokenizer (its files
and chat template, and the transformers version), and every setting that shapes the tokenized data
(`data.format`, `max_length`, `overlong`, `on_error`, `enable_thinking`, and `drafter.block_size`,
which sets the minimum of loss tokens). The schedule's settings (`data.seed`, `tokens_per_job`,
`bucket_boundaries`) and where or how the data is tokenized (`cache_dir`, `num_workers`) leave the
tokenized data as it is, so they are not part of the key: changing them reuses the entry.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np

from app.config.schema import Config, DataConfig
from app.data.dataset import DataSummary, TokenizedDataset
from app.data.shards import file_kind
from app.storage.roots import local_cache_dir

CACHE_VERSION = 2  # bump when the tokenizer path changes what it writes for the same inputs
_ARRAYS = ("tokens", "loss_mask", "offsets")
_DIGEST_CHUNK = 1 << 22  # bytes per read while hashing an input
# Files of a Hugging Face model folder that shape tokenization (weights and model config do not).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json")


def cache_root(cfg: Config) -> Path:
    """`data.cache_dir`, or `<checkpoint.dir>/data-cache` when it is empty. The cache is memory-mapped,
    so it must be a local (or mounted) path: with a URI `checkpoint.dir` (s3://...) the default is
    `data-cache` in the run's folder of this user's private cache root (`app.storage.roots.local_cache_dir`),
    which outlives the job's copy of the working directory, so a resubmitted job reuses it."""
    if cfg.data.cache_dir:
        return Path(cfg.data.cache_dir)
    return local_cache_dir(cfg.checkpoint.dir) / "data-cache"


def tokenizer_fingerprint(model_dir: str | Path, tokenizer) -> str:
    """Hash of the tokenizer's files, its chat template and the transformers version."""
    import transformers

    h = hashlib.sha256(transformers.__version__.encode())
    for name in _TOKENIZER_FILES:
        p = Path(model_dir) / name
        if p.is_file():
            h.update(name.encode())
            h.update(p.read_bytes())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()


def file_digest(path: str | Path) -> tuple[int, str]:
    """(bytes, SHA-256 hex) of a file's content, read in chunks (inputs of many GB never sit in memory)."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_DIGEST_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def cache_key(files: list[str], tokenizer_id: str, data: DataConfig, block_size: int) -> tuple[str, dict]:
    """(key, what it hashes) for tokenizing `files` with these settings."""
    inputs = []
    for f in files:
        file_kind(f)  # a missing file or a folder named *.jsonl is one data error line, not a traceback
        size, digest = file_digest(f)
        inputs.append({"path": str(Path(f).resolve()), "size": size, "sha256": digest})
    parts = {
        "version": CACHE_VERSION,
        "files": inputs,
        "tokenizer": tokenizer_id,
        "settings": {"format": data.format, "max_length": data.max_length, "overlong": data.overlong,
                     "on_error": data.on_error, "enable_thinking": data.enable_thinking,
                     "min_loss_tokens": 2 * block_size},
    }
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]
    return key, parts


def load(root: Path, key: str) -> TokenizedDataset | None:
    """The entry `key` under `root`, memory-mapped, or None when there is none."""
    entry = root / key
    if not (entry / "summary.json").is_file():
        return None
    arrays = {name: np.load(entry / f"{name}.npy", mmap_mode="r") for name in _ARRAYS}
    summary = DataSummary.from_dict(json.loads((entry / "summary.json").read_text()))
    return TokenizedDataset(summary=summary, **arrays)


def save(root: Path, key: str, dataset: TokenizedDataset, parts: dict) -> Path:
    """Write `dataset` as entry `key` under `root` (atomically); returns the entry's folder."""
    final = root / key
    if (final / "summary.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        for name in _ARRAYS:
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(getattr(dataset, name)))
        (tmp / "meta.json").write_text(json.dumps(parts, indent=2, sort_keys=True) + "\n")
        # summary.json last: its presence marks a complete entry.
        (tmp / "summary.json").write_text(json.dumps(dataset.summary.to_dict(), indent=2) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "summary.json").is_file():  # not another writer that got there first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
