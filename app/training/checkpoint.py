"""Atomic, rotating checkpoints of the drafter's training state and the ledger of trained jobs.

Layout of `<dir>/ckpt-<step>/`: `drafter.safetensors` (weights), `trainer.pt` (optimizer, scheduler,
RNG states), `state.json` (step, epoch, ledger of acked job ids as per-epoch bitmaps, `app/pool/book.py`;
older checkpoints hold a sorted id list, still read; extra counters). A checkpoint is
written into a temp folder and renamed into place, so a crash mid-write never leaves a half
checkpoint that resume would pick up. `<dir>` may also be a URI (`s3://...`): then the files go under
a fresh prefix and a marker written last publishes them (`app/storage/publish.py`); only marked
checkpoints are listed, and a checkpoint's location is then a URI string instead of a `Path`.

Each checkpoint carries the fencing token it was published under (app/storage/fence.py). A run that lost
the lease while paused mid-publish can still land one checkpoint after the new holder's: a checkpoint
under an older token than another at or below its step is such a stale writer's (or an abandoned branch
of a resumed run), and so is one of an older token that the lease holder did not find when it took the
folder (app/storage/claim.py: it landed before the holder's first checkpoint); such a checkpoint is never
listed, resumed from, rebuilt from or counted as kept; the holder's prune removes it.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from app.pool.book import ids_from_state as ledger_ids, to_json as ledger_json
from app.storage import claim
from app.storage.fetch import fetch_dir, read_text, release
from app.storage.orphans import clean_orphans as clean_local_orphans
from app.storage.roots import is_uri, open_storage

PREFIX = "ckpt-"
GENERATION_KEY = "group_generation"  # `extra` entry: the drafter group that wrote it (app/run/supervise/drafters.py)


@dataclass
class TrainState:
    """Everything needed to continue a run exactly where a checkpoint left it."""

    step: int
    epoch: int
    ledger: list[int]
    drafter: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    rng: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states (anchors are seeded per job; this covers everything else).
    Plain lists and tensors only, so `torch.load(weights_only=True)` reads them back."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, cached],
            "torch": torch.get_rng_state()}


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"].cpu())  # a CPU ByteTensor only, wherever the state was loaded


def save_checkpoint(root: str | Path, state: TrainState, keep: int) -> Path | str:
    """Write `state` atomically as `<root>/ckpt-<step>` and keep only the newest `keep`."""
    store = open_storage(root)
    name = f"{PREFIX}{state.step:08d}"
    tmp = store.stage(name)
    weights = {k: v.detach().contiguous().cpu() for k, v in state.drafter.items()}
    save_file(weights, str(tmp / "drafter.safetensors"))
    torch.save({"optimizer": state.optimizer, "scheduler": state.scheduler, "rng": state.rng}, tmp / "trainer.pt")
    meta = {"step": state.step, "epoch": state.epoch, "ledger_bitmaps": ledger_json(state.ledger), "extra": state.extra}
    (tmp / "state.json").write_text(json.dumps(meta))
    if not is_uri(root):  # on disk before the rename publishes them: a power cut never leaves empty files
        _fsync_tree(tmp)
    final = store.publish(tmp, name)
    if not is_uri(root):
        _fsync(Path(root))  # the rename itself
    _prune(root, keep)
    return final if is_uri(root) else Path(final)


def state_checksum(tensors: dict[str, torch.Tensor]) -> float:
    """sum(x + x^2) over every value in float64: equal weights give equal sums (a cheap identity check)."""
    with torch.no_grad():
        return float(sum(t.double().sum() + (t.double() ** 2).sum() for t in tensors.values()))


def _fsync_tree(folder: Path) -> None:
    for f in folder.iterdir():
        _fsync(f)
    _fsync(folder)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def clean_orphans(root: str | Path) -> list[str]:
    """Remove what a crash mid-save or mid-export left in a local checkpoint dir, and only names this
    project writes (app/storage/orphans.py). Called only under the run lease (app/run/lease.py): what
    it finds is a dead start's, never a live run's."""
    if is_uri(root) or not Path(root).is_dir():
        return []
    return clean_local_orphans(Path(root))


def _prune(root: str | Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints; remove older ones and those a stale writer landed after a
    takeover. Each delete is fenced (a run that lost the folder removes nothing: `FencedOut`) and leaves
    an entry of a newer token alone (app/storage/publish.py `delete`)."""
    store = open_storage(root)
    live, stale = _ranked(store)
    for old in stale + live[:-keep]:
        store.delete(old.name)


def _step(name: str) -> int:
    return int(name[len(PREFIX):])


def _ranked(store) -> tuple[list, list]:
    """(live entries oldest first, stale entries): an entry is stale when one published under a newer
    fencing token has a step at or below its own (the newer holder resumed before it was written), or
    when it is of an older token than the folder's lease holder and not among the entries that holder
    found when it took the folder (app/storage/claim.py: it landed after the takeover, before the
    holder's first checkpoint)."""
    entries = [e for e in store.entries(PREFIX) if e.name[len(PREFIX):].isdigit()]
    after = claim.landed_after(store, entries)  # published under an older token after the takeover
    live, stale = [], []
    for e in entries:
        newer = e.name in after or any(o.token > e.token and _step(o.name) <= _step(e.name) for o in entries)
        (stale if newer else live).append(e)
    return sorted(live, key=lambda e: _step(e.name)), stale


class RemoteCheckpoint(str):
    """A checkpoint's URI (`str`), with `.name` (`ckpt-<step>`) like a local checkpoint's `Path`."""

    name: str

    def __new__(cls, location: str, name: str) -> "RemoteCheckpoint":
        obj = super().__new__(cls, location)
        obj.name = name
        return obj


def list_checkpoints(root: str | Path) -> list[Path | RemoteCheckpoint]:
    """Complete checkpoints, oldest first (local: folders holding state.json; URI: marked ones), without
    those a stale writer published after a takeover (`_ranked`)."""
    entries, _ = _ranked(open_storage(root))
    if is_uri(root):
        return [RemoteCheckpoint(e.location, e.name) for e in entries]
    return [Path(e.location) for e in entries if (Path(e.location) / "state.json").is_file()]


def latest_checkpoint(root: str | Path) -> Path | RemoteCheckpoint | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def read_extra(path: str | Path) -> dict[str, Any]:
    """The `extra` entries saved with a checkpoint (e.g. the data fingerprint)."""
    return json.loads(read_text(path, "state.json")).get("extra", {})


def read_ledger(path: str | Path) -> tuple[int, int, list[int]]:
    """(step, epoch, ledger) of a checkpoint, without loading tensors (the driver needs only these)."""
    meta = json.loads(read_text(path, "state.json"))
    return int(meta["step"]), int(meta["epoch"]), ledger_ids(meta)


def load_checkpoint(path: str | Path, map_location: str = "cpu") -> TrainState:
    """The full state of a checkpoint (a URI's files are downloaded to a local cache first).

    `map_location` places the weights. `trainer.pt` is always read onto the CPU: its RNG states must
    stay CPU ByteTensors (`torch.set_rng_state` refuses any other, which crashed every GPU resume),
    and `optimizer.load_state_dict` moves the optimizer's state to its parameters' device itself."""
    local = fetch_dir(path)  # pinned (not evicted) until read: `release` below
    try:
        return _load_local(local, map_location)
    finally:
        release(local)


def _load_local(path: Path, map_location: str) -> TrainState:
    meta = json.loads((path / "state.json").read_text())
    # weights_only: a checkpoint folder (shared storage) must not be a way to run code in the driver
    # and every drafter. Older checkpoints hold numpy's RNG state as an array: allow exactly that.
    safe = [getattr(np, "_core", np).multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(safe):
        trainer = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    weights = load_file(str(path / "drafter.safetensors"), device="cpu")  # mmap'd; then moved in one pass
    return TrainState(
        step=int(meta["step"]), epoch=int(meta["epoch"]), ledger=ledger_ids(meta),
        drafter={k: v.to(map_location) for k, v in weights.items()},
        optimizer=trainer["optimizer"], scheduler=trainer["scheduler"], rng=trainer["rng"], extra=meta.get("extra", {}),
    )
