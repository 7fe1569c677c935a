"""Issue 22, item 17: what a long URI run costs on local disk, in memory and in the object store.

(a) the local disk a URI run uses is bounded (one copy of an export however often it is loaded, the
newest checkpoint versions only, a SIGKILLed stager's folder removed on the next start); (b) the timeline
is read as a stream; (c) the object-store check counts eval offers and the dataset; (d) transient
object-store errors are retried; (e) a URI save and load stream in chunks.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch) -> Path:
    """Every cache, staging and download folder under tmp_path (a fresh `<tmp>/dflash-<uid>/`)."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # the SIGKILLed subprocess stages there too
    from app.storage import cache_root

    return cache_root()


def _copies(root: Path, name: str) -> int:
    return sum(1 for _ in root.rglob(name))


# ---- (a) temp disk ------------------------------------------------------------------------------------

def _tiny_drafter(seed: int):
    from app.model.drafter import DFlashDrafter
    from tests.toy import tiny_arch, tiny_qwen3_config

    torch.manual_seed(seed)
    arch = tiny_arch(tiny_qwen3_config(), num_layers=1, block_size=4, target_layer_ids=(0, 2), mask_token_id=7)
    return DFlashDrafter(arch).eval(), arch


def _upload_export(tmp_path: Path, uri: str, seed: int) -> dict:
    """Export a drafter and upload it to `<uri>/drafter` as the driver does (in place, config.json last)."""
    from app.model.export import export_drafter
    from app.storage import open_storage

    drafter, arch = _tiny_drafter(seed)
    local = export_drafter(drafter, arch, tmp_path / f"export-{seed}")
    open_storage(uri).upload_dir(local, "drafter", last="config.json")
    return {k: v.clone() for k, v in drafter.state_dict().items()}


def test_loading_a_uri_export_again_reuses_its_one_copy(tmp_path: Path, private_tmp: Path) -> None:
    """(a) `load_drafter` on a URI copied the whole export into a fresh folder on every call, never
    removed (three loads: three copies). Now one copy, reused while the remote files are unchanged and
    replaced when the export is rewritten (the weights loaded are the new ones, still one copy)."""
    from app.model.export import load_drafter

    uri = f"file://{tmp_path / 'bucket' / 'run'}"
    first = _upload_export(tmp_path, uri, seed=1)
    for _ in range(3):
        drafter, _ = load_drafter(f"{uri}/drafter")
    assert _copies(private_tmp, "model.safetensors") == 1
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in first.items())

    second = _upload_export(tmp_path, uri, seed=2)
    drafter, _ = load_drafter(f"{uri}/drafter")
    assert any(not torch.equal(second[k], first[k]) for k in first)
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in second.items())
    assert _copies(private_tmp, "model.safetensors") == 1


def test_only_the_newest_checkpoint_versions_stay_cached(tmp_path: Path, private_tmp: Path) -> None:
    """(a) every checkpoint version a node loaded stayed in its cache (five resumes: five copies of the
    weights and optimizer). Now at most KEEP_VERSIONS per run root, the newest loaded ones, and a
    checkpoint loaded twice is downloaded once."""
    from app.local_cache import KEEP_VERSIONS
    from app.training.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint

    uri = f"file://{tmp_path / 'bucket' / 'run'}"
    for step in range(1, 6):
        save_checkpoint(uri, TrainState(step=step, epoch=0, ledger=[step], drafter={"w": torch.full((4,), step)}),
                        keep=10)
        state = load_checkpoint(latest_checkpoint(uri))
        assert state.step == step and torch.equal(state.drafter["w"], torch.full((4,), step))
    assert KEEP_VERSIONS == 2 and _copies(private_tmp, "drafter.safetensors") == KEEP_VERSIONS
    before = sorted(p.stat().st_ino for p in private_tmp.rglob("drafter.safetensors"))
    assert load_checkpoint(latest_checkpoint(uri)).step == 5
    assert sorted(p.stat().st_ino for p in private_tmp.rglob("drafter.safetensors")) == before  # reused


def test_a_sigkilled_stager_s_folder_is_removed_on_the_next_start(tmp_path: Path, private_tmp: Path) -> None:
    """(a) a process killed mid-save (SIGKILL: no finally runs) left its staging folder in the cache
    forever. The next process that stages or downloads removes it; a live process's staging, a planted
    symlink's target and other folders stay."""
    from app import local_cache

    uri = f"file://{tmp_path / 'bucket' / 'run'}"
    code = ("import os, signal, sys; from app.storage import open_storage; "
            f"p = open_storage({uri!r}).stage('ckpt-00000007'); (p / 'drafter.safetensors').write_bytes(b'x' * 1000); "
            "print(p, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=os.environ)
    assert out.returncode == -9, out.stderr
    dead = Path(out.stdout.strip())
    assert dead.parent == private_tmp and dead.is_dir()  # what the kill left behind

    mine = local_cache.owned_tmp("stage-ckpt-00000008-", private_tmp)  # this (live) process's staging
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (private_tmp / f"stage-x-1@{__import__('socket').gethostname()}-abcdefgh").symlink_to(outside)
    (private_tmp / "run-0123456789ab").mkdir()  # a run's own cache folder
    removed = local_cache.clean_stale(private_tmp)
    assert dead.name in removed and not dead.exists()
    assert mine.is_dir() and (outside / "keep.txt").read_text() == "keep"
    assert (private_tmp / "run-0123456789ab").is_dir()
    assert not any(p.is_symlink() for p in private_tmp.iterdir())


# ---- (e) a URI save and load stream --------------------------------------------------------------------

def test_a_uri_save_and_load_stream_in_chunks(tmp_path: Path, private_tmp: Path) -> None:
    """(e) publishing a staged checkpoint read each file whole into memory (a 64 MiB file: a 64 MiB
    peak; a real one is several GB), and so did its download. Both now hold one CHUNK at a time: the
    Python heap's peak stays under 1.5 chunks, a fifth of the file, and the bytes arrive intact."""
    import hashlib
    import tracemalloc

    from app.storage import CHUNK, fetch_dir, open_storage

    size = 64 << 20
    store = open_storage(f"file://{tmp_path / 'bucket' / 'run'}")
    staged = store.stage("ckpt-00000001")
    with open(staged / "drafter.safetensors", "wb") as f:
        f.truncate(size)  # sparse: no time spent writing it
        f.seek(size // 2)
        f.write(b"the middle")
    digest = hashlib.sha256((staged / "drafter.safetensors").read_bytes()).hexdigest()

    tracemalloc.start()
    try:
        location = store.publish(staged, "ckpt-00000001")
        _, save_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        local = fetch_dir(location)
        _, load_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 1.5 * CHUNK < size / 5
    assert save_peak < 1.5 * CHUNK and load_peak < 1.5 * CHUNK, (save_peak, load_peak)
    assert hashlib.sha256((local / "drafter.safetensors").read_bytes()).hexdigest() == digest
