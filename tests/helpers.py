"""What many test files share: the repository root, a job's payload (`hidden_batch`), contenders racing for one
thing at one moment (`race`), and a run root on local disk or on the loopback S3 server (`storage_root`).

The toy targets, drafters and their LAYERS/PROMPTS live in tests/toy.py; the pool's jobs in tests/pool_helpers.py;
the end-to-end driver runs in tests/e2e_helpers.py.
"""
from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[1]  # the checkout: conf/, Makefile, README.md, app/
T = TypeVar("T")


def hidden_batch(job_id: int = 0, *, seqs: int = 2, tokens: int = 6, width: int = 8, dtype: str = "bfloat16",
                 lengths: list[int] | None = None, read_only: bool = True):
    """A job's `HiddenBatch` as the object store hands it out (`read_only`): features drawn from `job_id`'s
    seed in `dtype` ("bfloat16" as its uint16 view, "float8_e4m3" through the real codec, or "float32"),
    token ids under 100, every position in the loss, each sequence `tokens` long unless `lengths` says."""
    import numpy as np
    import torch

    from app.messages import HiddenBatch
    from app.model.feature_codec import encode_fp8

    rng = np.random.default_rng(job_id)
    feats = torch.from_numpy(rng.standard_normal((seqs, tokens, width), dtype=np.float32))
    scale = None
    if dtype == "float8_e4m3":
        codes, scales = encode_fp8(feats)
        hidden, scale = codes.view(torch.uint8).numpy(), scales.numpy()
    elif dtype == "bfloat16":
        hidden = feats.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    else:
        assert dtype == "float32", dtype
        hidden = feats.numpy()
    if read_only:
        hidden.flags.writeable = False
    return HiddenBatch(job_id=job_id, hidden_BSD=hidden, hidden_dtype=dtype, hidden_scale_BS=scale,
                       input_ids_BS=rng.integers(0, 100, (seqs, tokens)), loss_mask_BS=np.ones((seqs, tokens), np.uint8),
                       lengths_B=np.array(lengths if lengths is not None else [tokens] * seqs, np.int64))


def race(make: Callable[[], T], take: Callable[[T], object], refused: type[Exception], takers: int = 8,
         ready: Callable[[], None] | None = None) -> tuple[list[T], list[Exception]]:
    """`takers` threads each `make()` a contender (and call `ready()`, in that thread), wait at one barrier, then
    `take(contender)` at the same moment: (the contenders that took it, the `refused` errors of the others)."""
    start, won, lost, lock = threading.Barrier(takers), [], [], threading.Lock()

    def one() -> None:
        contender = make()
        if ready is not None:
            ready()
        start.wait(timeout=30)
        try:
            take(contender)
            with lock:
                won.append(contender)
        except refused as exc:
            with lock:
                lost.append(exc)

    threads = [threading.Thread(target=one) for _ in range(takers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return won, lost


def storage_root(kind: str, tmp_path: Path, request, name: str) -> str:
    """A fresh run root: a local folder (`kind="local"`), or a prefix on the loopback S3 server (`"s3"`) with
    the `atomic_puts` fixture on (tests/conftest.py)."""
    if kind == "s3":
        s3 = request.getfixturevalue("s3")
        request.getfixturevalue("atomic_puts")
        return s3.uri(f"{name}-{uuid.uuid4().hex[:6]}")
    assert kind == "local", kind
    return str(tmp_path / name)
