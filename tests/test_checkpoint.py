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


class _Exploit:
    """A pickle that runs code when loaded: what a hostile trainer.pt on shared storage would hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_loading_never_unpickles_arbitrary_objects(tmp_path: Path) -> None:
    import pickle

    import pytest

    path = save_checkpoint(tmp_path / "run", _state(2), keep=1)
    marker = tmp_path / "pwned"
    torch.save({"optimizer": _Exploit(marker), "scheduler": None, "rng": None}, path / "trainer.pt")
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(path)
    assert not marker.exists()


def test_real_optimizer_scheduler_and_rng_states_load_with_weights_only(tmp_path: Path) -> None:
    import random

    import numpy as np

    from app.training.checkpoint import restore_rng, rng_state
    from app.training.trainer import warmup_cosine

    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(10, 0.1))
    w.grad = torch.ones(3)
    opt.step()
    sched.step()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = TrainState(step=1, epoch=0, ledger=[], drafter={"w": w.detach()}, optimizer=opt.state_dict(),
                       scheduler=sched.state_dict(), rng=rng_state())
    expect = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    loaded = load_checkpoint(save_checkpoint(tmp_path, state, keep=1))
    restore_rng(loaded.rng)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expect
    assert torch.equal(loaded.optimizer["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert loaded.scheduler["last_epoch"] == 1


def test_rewriting_a_step_with_keep_1_always_leaves_a_complete_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """Every rename during the rewrite sees a complete checkpoint (the old code set the only one aside first)."""
    save_checkpoint(tmp_path, _state(4), keep=1)
    seen: list[int] = []
    real_rename = Path.rename

    def rename(self, target):
        seen.append(len(list_checkpoints(tmp_path)))
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    again = _state(4)
    again.ledger = [9]
    save_checkpoint(tmp_path, again, keep=1)
    assert 0 not in seen
    assert read_ledger(latest_checkpoint(tmp_path))[2] == [9]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000004"]


def test_files_and_folders_are_fsynced_before_the_rename_publishes_them(tmp_path: Path, monkeypatch) -> None:
    import os

    synced: list[str] = []
    real_fsync, real_open = os.fsync, os.open
    names: dict[int, str] = {}

    def track_open(path, flags, *a, **kw):
        fd = real_open(path, flags, *a, **kw)
        names[fd] = str(path)
        return fd

    def track_fsync(fd):
        synced.append(Path(names.get(fd, "?")).name)
        return real_fsync(fd)

    monkeypatch.setattr(os, "open", track_open)
    monkeypatch.setattr(os, "fsync", track_fsync)
    save_checkpoint(tmp_path / "run", _state(2), keep=1)
    staged = next(n for n in synced if n.startswith(".dflash-tmp-ckpt-00000002-"))  # staged under a unique name
    for name in ("drafter.safetensors", "trainer.pt", "state.json", staged, "run"):
        assert name in synced, (name, synced)
    assert synced.index(staged) < synced.index("run")  # the folder before the rename's parent


def test_orphans_of_a_crash_mid_save_are_cleaned_on_start(tmp_path: Path) -> None:
    from app.training.checkpoint import clean_orphans

    save_checkpoint(tmp_path, _state(2), keep=3)
    save_checkpoint(tmp_path, _state(4), keep=3)
    (tmp_path / ".tmp-ckpt-00000006").mkdir()  # crashed while writing step 6
    (tmp_path / "ckpt-00000004").rename(tmp_path / ".old-ckpt-00000004")  # crashed between the two renames
    done = clean_orphans(tmp_path)
    assert sorted(done) == ["removed .tmp-ckpt-00000006", "restored ckpt-00000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000002", "ckpt-00000004"]
    assert read_ledger(latest_checkpoint(tmp_path))[0] == 4


def test_resume_fingerprint_covers_the_target_and_its_layers() -> None:
    """Job ids of one target's features are other data for another target or other layers."""
    from types import SimpleNamespace

    import numpy as np

    from app.config.load import load_config
    from app.run.plan import data_fingerprint

    root = Path(__file__).resolve().parents[1]
    data = SimpleNamespace(tokens=np.arange(10), loss_mask=np.ones(10), offsets=np.array([0, 10]))
    base = data_fingerprint(data, load_config(root / "conf/tiny.yaml", []))
    assert data_fingerprint(data, load_config(root / "conf/tiny.yaml", [])) == base
    assert data_fingerprint(data, load_config(root / "conf/tiny.yaml", ["model.target_layer_ids=[1,2]"])) != base
    cfg = load_config(root / "conf/tiny.yaml", [])
    other = SimpleNamespace(data=cfg.data, model=SimpleNamespace(target="/models/other", target_layer_ids=[]))
    assert data_fingerprint(data, other) != base


def test_rng_and_optimizer_restore_from_a_checkpoint_loaded_onto_another_device(tmp_path: Path) -> None:
    """GPU resume (issue 23, item 1): loading onto a device moved the CPU RNG state there and
    `torch.set_rng_state` raised TypeError. `meta` stands in for CUDA: any non-CPU map_location."""
    import random

    import numpy as np

    from app.training.checkpoint import restore_rng, rng_state

    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w], lr=0.1)
    w.grad = torch.ones(3)
    opt.step()
    torch.manual_seed(7)
    state = TrainState(step=1, epoch=0, ledger=[], drafter={"w": w.detach()}, optimizer=opt.state_dict(), rng=rng_state())
    expect = float(torch.rand(1))
    loaded = load_checkpoint(save_checkpoint(tmp_path, state, keep=1), map_location="meta")
    assert loaded.drafter["w"].device.type == "meta"  # the weights go where asked
    assert loaded.rng["torch"].device.type == "cpu" and loaded.rng["torch"].dtype == torch.uint8
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    restore_rng(loaded.rng)
    assert float(torch.rand(1)) == expect
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    fresh.load_state_dict(loaded.optimizer)  # moved to the parameter's device by the optimizer itself
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
