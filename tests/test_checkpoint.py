"""Atomic, rotating checkpoints and exact state round trips (no Ray)."""
from __future__ import annotations

from pathlib import Path

import torch

from app.training.checkpoint import TrainState, latest_checkpoint, list_checkpoints, load_checkpoint, read_ledger, save_checkpoint


def _state(step: int) -> TrainState:
    return TrainState(step=step, epoch=1, ledger=[5, 3, step], drafter={"w": torch.full((2, 2), float(step))},
                      optimizer={"lr": 0.1}, scheduler={"last_epoch": step}, rng=None)


def test_keeps_the_newest_and_round_trips(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        save_checkpoint(tmp_path, _state(step), keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000006", "ckpt-00000008"]
    assert read_ledger(latest_checkpoint(tmp_path)) == (8, 1, [3, 5, 8])
    state = load_checkpoint(latest_checkpoint(tmp_path))
    assert torch.equal(state.drafter["w"], torch.full((2, 2), 8.0)) and state.scheduler == {"last_epoch": 8}


def test_rewriting_a_step_replaces_it_and_leaves_no_temp_folders(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, _state(4), keep=1)
    again = _state(4)
    again.ledger = [1, 2]
    save_checkpoint(tmp_path, again, keep=1)
    assert read_ledger(latest_checkpoint(tmp_path))[2] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000004"]


def test_a_half_written_checkpoint_is_never_picked(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, _state(2), keep=3)
    (tmp_path / ".tmp-ckpt-00000004").mkdir()  # a crash mid-write
    (tmp_path / "ckpt-00000006").mkdir()  # no state.json: incomplete
    assert latest_checkpoint(tmp_path).name == "ckpt-00000002"
