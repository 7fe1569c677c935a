"""Issue 35, round two: the URI download cache is bounded on every node. Per node at most
KEEP_DOWNLOADS entries stay (the most recently used; one used within BUSY_S stays whatever the count),
held at each install and at start; a run's own entries (its checkpoint versions and exports) are removed
when its lease is released; only entries this project made (their names, real folders, this user's)
are touched. A temp dir as the cache root; no Ray."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from app.storage import local_cache


@pytest.fixture
def downloads(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    folder = local_cache.cache_root() / local_cache.DOWNLOADS
    folder.mkdir(mode=0o700)
    return folder


def _entry(folder: Path, name: str, used: float, keys: tuple[str, ...] = ("b/other/x.bin",)) -> Path:
    entry = folder / name
    (entry / "files").mkdir(parents=True)
    (entry / "files" / "x.bin").write_bytes(b"x" * 64)
    (entry / "manifest.json").write_text(json.dumps([[k, 64, 0] for k in keys]))
    os.utime(entry, (used, used))
    return entry


def test_the_node_keeps_its_newest_downloads_and_leaves_what_it_did_not_make(downloads: Path, tmp_path: Path) -> None:
    """Nine entries of nine families, used an hour apart: the six most recently used stay. A link named
    like an entry (to a user's folder), a user's folder and a file are neither counted nor touched."""
    now = time.time()
    made = [_entry(downloads, f"{i:012x}-{'a' * 12}", now - 3600 * (i + 1)) for i in range(9)]
    user = tmp_path / "user-data"
    (user / "files").mkdir(parents=True)
    (downloads / f"{'f' * 12}-{'e' * 12}").symlink_to(user)
    (downloads / "notes").mkdir()
    (downloads / "readme.txt").write_text("mine")
    removed = local_cache.bound_downloads(downloads, now)
    assert sorted(removed) == sorted(p.name for p in made[local_cache.KEEP_DOWNLOADS:])
    assert [p.exists() for p in made] == [True] * local_cache.KEEP_DOWNLOADS + [False] * (9 - local_cache.KEEP_DOWNLOADS)
    assert (user / "files").is_dir() and (downloads / "notes").is_dir() and (downloads / "readme.txt").is_file()
    assert local_cache.KEEP_DOWNLOADS == 6


def test_an_entry_used_a_moment_ago_is_never_evicted_for_the_bound(downloads: Path) -> None:
    now = time.time()
    old = [_entry(downloads, f"{i:012x}-{'b' * 12}", now - 7200 - i) for i in range(local_cache.KEEP_DOWNLOADS)]
    busy = _entry(downloads, f"{'c' * 12}-{'c' * 12}", now - local_cache.BUSY_S - 7300)
    os.utime(busy, (now - 5, now - 5))  # just read by a live process: the newest, stays
    beyond = _entry(downloads, f"{'d' * 12}-{'d' * 12}", now - 9000)
    assert local_cache.bound_downloads(downloads, now) == [old[-1].name, beyond.name]
    assert busy.is_dir()


def test_an_install_holds_the_node_bound(downloads: Path) -> None:
    """Before: each family kept its own two versions and the node's total grew with every run."""
    now = time.time()
    for i in range(10):
        _entry(downloads, f"{i:012x}-{'a' * 12}", now - 3600 * (i + 1))
    new = _entry(downloads, f"{'9' * 12}-{'1' * 12}", now)
    local_cache.evict(new, "9" * 12, keep=local_cache.KEEP_VERSIONS)
    names = [p.name for p in downloads.iterdir()]
    assert len(names) == local_cache.KEEP_DOWNLOADS and new.name in names


def test_start_up_cleanup_holds_the_node_bound(downloads: Path) -> None:
    now = time.time()
    for i in range(8):
        _entry(downloads, f"{i:012x}-{'a' * 12}", now - 3600 * (i + 1))
    removed = local_cache.clean_stale(downloads.parent, now=now)
    assert sorted(removed) == [f"{i:012x}-{'a' * 12}" for i in (6, 7)]
    assert len(list(downloads.iterdir())) == 6


def test_a_run_s_downloads_go_when_it_ends_and_no_one_else_s(downloads: Path) -> None:
    now = time.time()
    ours = [_entry(downloads, f"{'1' * 12}-{i:012x}", now, (f"b/run/ckpt-0000000{i}/v-0123456789ab/w.bin",))
            for i in range(2)]
    export = _entry(downloads, f"{'2' * 12}-{'2' * 12}", now, ("b/run/drafter/config.json", "b/run/drafter/w.bin"))
    neighbour = _entry(downloads, f"{'3' * 12}-{'3' * 12}", now, ("b/runner/drafter/w.bin",))  # a name that starts alike
    mixed = _entry(downloads, f"{'4' * 12}-{'4' * 12}", now, ("b/run/a.bin", "b/other/a.bin"))
    no_manifest = _entry(downloads, f"{'5' * 12}-{'5' * 12}", now)
    (no_manifest / "manifest.json").unlink()
    removed = local_cache.forget_downloads("b/run", downloads.parent)
    assert sorted(removed) == sorted([*(p.name for p in ours), export.name])
    assert neighbour.is_dir() and mixed.is_dir() and no_manifest.is_dir()


def test_releasing_a_uri_run_s_lease_removes_its_downloads_on_this_node(downloads: Path, tmp_path: Path, monkeypatch) -> None:
    """A file:// run: a checkpoint version fetched into the cache (as a resume does), then the run ends."""
    from app.run.lease import RunLease
    from app.storage import fence
    from app.storage.fetch import fetch_dir
    from app.storage.roots import open_storage

    monkeypatch.setattr(fence, "_mine", {})
    root = f"file://{tmp_path / 'bucket' / 'run'}"
    lease = RunLease(root, 60).acquire()
    store = open_storage(root)
    staged = store.stage("ckpt-00000002")
    (staged / "state.json").write_text("{}")
    local = fetch_dir(store.publish(staged, "ckpt-00000002"))
    assert (local / "state.json").is_file() and len(list(downloads.iterdir())) == 1
    lease.release()
    assert list(downloads.iterdir()) == [] and not local.exists()
