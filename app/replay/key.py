"""What a sequence's stored features depend on: the target's weights, its layers and the payload dtype
(the key, one folder of the store), and the sequence's own token ids (its entry's name).

Entries are named by the digest of their token ids, not by job or dataset row: a job of another epoch
(the schedule regroups sequences every epoch), another schedule or another dataset that holds the
same sequence finds it, and a sequence never finds another's features.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

FORMAT = 1  # raise when the entry layout or what features mean changes: older stores become misses
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
WHOLE_HASH_BYTES = 256 << 20  # weight files up to this are hashed whole; larger ones sampled (below)
SAMPLE_BYTES = 16 << 20  # head, middle and tail of a larger file, with its size
_BLOB = re.compile(r"[0-9a-f]{64}")  # a Hugging Face cache blob's name: the file's sha256


@dataclass(frozen=True)
class ReplayKey:
    """The store's key: a sequence's features from `weights` at `layers`, travelling as `payload_dtype`."""

    weights: str  # weights_digest of the target folder
    layers: tuple[int, ...]
    payload_dtype: str  # bfloat16 | float16 | float32 | float8_e4m3 (the HiddenBatch's hidden_dtype)
    format: int = FORMAT

    def to_dict(self) -> dict:
        return {**asdict(self), "layers": list(self.layers)}

    @property
    def folder(self) -> str:
        """The key's folder in the store: a digest of every field, so another target, layer set or dtype misses."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return "k-" + hashlib.sha256(text.encode()).hexdigest()[:20]


def payload_dtype(feature_dtype: str, compute_dtype) -> str:
    """The `HiddenBatch.hidden_dtype` a target's forward produces (app/data/target_forward.py pack_hidden)."""
    import torch

    if feature_dtype == "float8_e4m3":
        return "float8_e4m3"
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(compute_dtype, "float32")


def sequence_name(input_ids: np.ndarray) -> str:
    """An entry's name: the sha256 of the sequence's token ids (as int64), 40 hex digits."""
    ids = np.ascontiguousarray(np.asarray(input_ids, dtype=np.int64))
    return hashlib.sha256(ids.data).hexdigest()[:40]


def weights_digest(model_dir: str | Path) -> str:
    """A digest of the target's weights and config: a Hugging Face cache blob by its own name (its sha256),
    a file up to 256 MiB hashed whole, a larger one by its size and three 16 MiB samples (a changed file of
    the same size whose samples agree would go unseen: retrain-in-place of a multi-GB file is that rare)."""
    root = Path(model_dir)
    files = [root] if root.is_file() else sorted(p for p in root.iterdir()
                                                 if p.suffix in WEIGHT_SUFFIXES or p.name == "config.json")
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode() + b"\0" + _file_digest(path).encode() + b"\0")
    return h.hexdigest()[:32]


def _file_digest(path: Path) -> str:
    blob = path.resolve().name
    if path.is_symlink() and _BLOB.fullmatch(blob):
        return blob
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        if size <= WHOLE_HASH_BYTES:
            for chunk in iter(lambda: f.read(8 << 20), b""):
                h.update(chunk)
        else:
            for at in (0, size // 2, size - SAMPLE_BYTES):
                f.seek(at)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()
