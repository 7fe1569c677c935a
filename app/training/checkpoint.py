"""Atomic, rotating checkpoints of the drafter's training state and the ledger of trained jobs.

Layout of `<dir>/ckpt-<step>/`: `drafter.safetensors` (weights), `trainer.pt` (optimizer, scheduler,
RNG states), `state.json` (step, epoch, ledger of acked job ids, extra counters). A checkpoint is
written into a temp folder and renamed into place, so a crash mid-write never leaves a half
checkpoint that resume would pick up.
"""
from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

PREFIX = "ckpt-"


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
    """Python, numpy and torch RNG states (anchors are seeded per job; this covers everything else)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(root: str | Path, state: TrainState, keep: int) -> Path:
    """Write `state` atomically as `<root>/ckpt-<step>` and keep only the newest `keep`."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{state.step:08d}"
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    weights = {k: v.detach().contiguous().cpu() for k, v in state.drafter.items()}
    save_file(weights, str(tmp / "drafter.safetensors"))
    torch.save({"optimizer": state.optimizer, "scheduler": state.scheduler, "rng": state.rng}, tmp / "trainer.pt")
    meta = {"step": state.step, "epoch": state.epoch, "ledger": sorted(state.ledger), "extra": state.extra}
    (tmp / "state.json").write_text(json.dumps(meta))
    old = root / f".old-{final.name}"
    if final.exists():  # same step written twice (e.g. a stop right after a periodic save)
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)  # set aside, not deleted, until the new one is in place
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    _prune(root, keep)
    return final


def _prune(root: Path, keep: int) -> None:
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def read_extra(path: str | Path) -> dict[str, Any]:
    """The `extra` entries saved with a checkpoint (e.g. the data fingerprint)."""
    return json.loads((Path(path) / "state.json").read_text()).get("extra", {})


def read_ledger(path: str | Path) -> tuple[int, int, list[int]]:
    """(step, epoch, ledger) of a checkpoint, without loading tensors (the driver needs only these)."""
    meta = json.loads((Path(path) / "state.json").read_text())
    return int(meta["step"]), int(meta["epoch"]), [int(j) for j in meta["ledger"]]


def load_checkpoint(path: str | Path, map_location: str = "cpu") -> TrainState:
    path = Path(path)
    meta = json.loads((path / "state.json").read_text())
    trainer = torch.load(path / "trainer.pt", map_location=map_location, weights_only=False)
    return TrainState(
        step=int(meta["step"]), epoch=int(meta["epoch"]), ledger=[int(j) for j in meta["ledger"]],
        drafter=load_file(str(path / "drafter.safetensors"), device=map_location),
        optimizer=trainer["optimizer"], scheduler=trainer["scheduler"], rng=trainer["rng"], extra=meta.get("extra", {}),
    )
