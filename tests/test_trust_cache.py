"""The URI download cache is bounded on every node, in bytes (issue 49, item 5; before: issue 35's count of
six entries, where any entry used in the last ten minutes stayed, so twelve recent ones all did). Least
recently used entries go first until the node's entries fit `checkpoint.download_cache_gb`, at each
install and at start; an entry a process pins (a shared lock held while it reads, from the fetch on) is
never removed, nor replaced in place; a run's own entries (recorded location under its root, exactly) go
when its lease is released; only entries this project made are touched. A temp dir as the cache root;
sizes are sparse files; no Ray.

Checked against the code before this change (2f4199a): the byte-bound, pin and forget tests failed there
(twelve recent entries all stayed; the bound had no pins; forget removed a nested root's entries and the
same path's on another endpoint).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.storage import local_cache

MIB = 1 << 20
META = 4096  # an entry's manifest, location and pin file: counted too, a few hundred bytes


@pytest.fixture
def downloads(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    folder = local_cache.cache_root() / local_cache.DOWNLOADS
    folder.mkdir(mode=0o700)
    return folder


def _entry(folder: Path, name: str, used: float, size: int = 64, location: str = "s3://b/other/x") -> Path:
    entry = folder / name
    (entry / "files").mkdir(parents=True)
    with open(entry / "files" / "x.bin", "wb") as out:
        out.truncate(size)  # sparse: the bound counts a file's size, never less than its disk use
    (entry / "manifest.json").write_text(json.dumps([["b/x.bin", size, 0]]))
    (entry / "location").write_text(location)
    (entry / "pin.lock").touch()  # as a fetch installs it
    os.utime(entry, (used, used))
    return entry


def _held_elsewhere(entry: Path) -> subprocess.Popen:
    """A running job in another process that reads `entry`: it holds the entry's pin (a shared flock on its
    pin.lock, app/storage/pins.py) until stdin closes."""
    code = ("import fcntl, os, sys; fd = os.open(os.path.join(sys.argv[1], 'pin.lock'), os.O_RDWR); "
            "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(entry)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[1])
    assert proc.stdout.readline().strip() == "held"
    return proc


def _bytes(folder: Path) -> int:
    """Every file's size under the download folder, counted here (not by the cache's own sum)."""
    return sum(os.lstat(os.path.join(d, f)).st_size for d, _, files in os.walk(folder) for f in files)


def test_twelve_recent_entries_are_held_to_the_byte_bound_and_a_pinned_one_stays(downloads: Path, monkeypatch) -> None:
    """Twelve 1 MiB entries, all used in the last minute, the oldest read by a running job; a bound of
    4 MiB. The install of the newest evicts the least recently used unpinned ones: the pinned oldest and
    the three newest stay (4 MiB). Once the job ends, the next install evicts it too."""
    monkeypatch.setattr(local_cache, "_bound", [4 * MIB + META], raising=False)
    now = time.time()
    made = [_entry(downloads, f"{i:012x}-{'a' * 12}", now - 60 + i, MIB) for i in range(12)]
    job = _held_elsewhere(made[0])
    try:
        local_cache.evict(made[-1], f"{11:012x}", keep=local_cache.KEEP_VERSIONS)
        assert sorted(p.name for p in downloads.iterdir()) == sorted(p.name for p in [made[0], *made[-3:]])
        assert 4 * MIB <= _bytes(downloads) <= 4 * MIB + META
    finally:
        job.stdin.close()
        job.wait(timeout=30)
    newest = _entry(downloads, f"{'c' * 12}-{'c' * 12}", now + 1, MIB)
    local_cache.evict(newest, "c" * 12, keep=local_cache.KEEP_VERSIONS)
    assert sorted(p.name for p in downloads.iterdir()) == sorted(p.name for p in [*made[-3:], newest])


def test_the_node_bound_leaves_what_it_did_not_make(downloads: Path, tmp_path: Path) -> None:
    """A link named like an entry (to a user's folder), a user's folder and a file are neither counted
    nor touched; of ours the least recently used go until the rest fit."""
    now = time.time()
    made = [_entry(downloads, f"{i:012x}-{'a' * 12}", now - 3600 * (i + 1), MIB) for i in range(5)]
    user = tmp_path / "user-data"
    (user / "files").mkdir(parents=True)
    (downloads / f"{'f' * 12}-{'e' * 12}").symlink_to(user)
    (downloads / "notes").mkdir()
    (downloads / "readme.txt").write_text("mine")
    removed = local_cache.bound_downloads(downloads, now, max_bytes=2 * MIB + META)
    assert sorted(removed) == sorted(p.name for p in made[2:])
    assert (user / "files").is_dir() and (downloads / "notes").is_dir() and (downloads / "readme.txt").is_file()


def test_start_up_cleanup_holds_the_byte_bound(downloads: Path, monkeypatch) -> None:
    monkeypatch.setattr(local_cache, "_bound", [3 * MIB + META], raising=False)
    now = time.time()
    for i in range(5):
        _entry(downloads, f"{i:012x}-{'a' * 12}", now - 3600 * (i + 1), MIB)
    removed = local_cache.clean_stale(downloads.parent, now=now)
    assert sorted(removed) == [f"{i:012x}-{'a' * 12}" for i in (3, 4)]
    assert 3 * MIB <= _bytes(downloads) <= 3 * MIB + META


def test_a_fetched_copy_is_pinned_until_released(downloads: Path, tmp_path: Path, monkeypatch) -> None:
    """Three checkpoint versions of three file:// roots, 1 MiB each, a bound of 2.5 MiB. The first is
    still being read (not released), the second was released: the third fetch evicts the second, never
    the first. Before: nothing pinned, and a count of six kept all three."""
    from app.storage.fetch import fetch_dir, release

    monkeypatch.setattr(local_cache, "_bound", [int(2.5 * MIB)], raising=False)
    got = []
    for name in ("a", "b", "c"):
        version = tmp_path / "bucket" / name / "ckpt-00000002" / "v-0123456789ab"
        version.mkdir(parents=True)
        with open(version / "w.bin", "wb") as out:
            out.truncate(MIB)
        got.append(fetch_dir(f"file://{version}"))
        if name == "b":
            release(got[-1])
    assert got[0].is_dir() and not got[1].exists() and got[2].is_dir()
    assert _bytes(downloads) <= int(2.5 * MIB)
    release(got[0])
    release(got[2])


def test_a_reinstall_never_replaces_a_copy_another_process_reads(downloads: Path, monkeypatch) -> None:
    """An export folder rewritten in place is downloaded again while a job still reads the old copy: the
    old copy is set aside (a name of its family), not deleted under the reader; it goes once unpinned."""
    entry = _entry(downloads, f"{'e' * 12}-{'1' * 12}", time.time(), 64)
    job = _held_elsewhere(entry)
    try:
        tmp = local_cache.owned_tmp(".fetch-", downloads)
        (tmp / "files").mkdir()
        (tmp / "files" / "x.bin").write_bytes(b"new")
        local_cache.install(tmp, entry)
        assert (entry / "files" / "x.bin").read_bytes() == b"new"
        aside = [p for p in downloads.iterdir() if p.name.startswith("e" * 12) and p != entry]
        assert len(aside) == 1 and (aside[0] / "files" / "x.bin").stat().st_size == 64
    finally:
        job.stdin.close()
        job.wait(timeout=30)
    assert local_cache.evict(entry, "e" * 12, keep=1) == [aside[0].name]


def test_a_run_s_downloads_go_when_it_ends_and_no_other_run_s(downloads: Path) -> None:
    """Only entries of this root, exactly: a live run under a nested root, the same bucket path on another
    endpoint, a name that starts alike and a pinned entry stay. Before: every entry whose keys started with
    the root's path went, the nested run's and the other endpoint's included."""
    root = "s3://b/run?endpoint_override=h:1&scheme=http"
    now = time.time()

    def made(name: str, location: str) -> Path:
        return _entry(downloads, name, now, 64, location)

    ours = [made(f"{'1' * 12}-{'1' * 12}", "s3://b/run/ckpt-00000002/v-0123456789ab?endpoint_override=h:1&scheme=http"),
            made(f"{'2' * 12}-{'2' * 12}", "s3://b/run/drafter?endpoint_override=h:1&scheme=http")]
    nested = made(f"{'3' * 12}-{'3' * 12}", "s3://b/run/runs/a/ckpt-00000002/v-0123456789ab?endpoint_override=h:1&scheme=http")
    elsewhere = made(f"{'4' * 12}-{'4' * 12}", "s3://b/run/drafter?endpoint_override=h:2&scheme=http")
    alike = made(f"{'5' * 12}-{'5' * 12}", "s3://b/runner/drafter?endpoint_override=h:1&scheme=http")
    busy = made(f"{'6' * 12}-{'6' * 12}", "s3://b/run/ckpt-00000004/v-0123456789ac?endpoint_override=h:1&scheme=http")
    job = _held_elsewhere(busy)
    try:
        removed = local_cache.forget_downloads(root, downloads.parent)
    finally:
        job.stdin.close()
        job.wait(timeout=30)
    assert sorted(removed) == sorted(p.name for p in ours)
    assert all(p.is_dir() for p in (nested, elsewhere, alike, busy))


def test_releasing_a_uri_run_s_lease_removes_its_downloads_on_this_node(downloads: Path, tmp_path: Path, monkeypatch) -> None:
    """A file:// run: a checkpoint version fetched into the cache (as a resume does; this process still
    pins it), then the run ends in this process: its own pins go with it, and so do its downloads."""
    from app.run.lease import RunLease
    from app.storage import fence
    from app.storage.fetch import fetch_dir
    from app.storage import pins
    from app.storage.roots import open_storage

    monkeypatch.setattr(fence, "_mine", {})
    monkeypatch.setattr(pins, "_held", {})  # this process's pins from earlier tests are not this run's
    root = f"file://{tmp_path / 'bucket' / 'run'}"
    lease = RunLease(root, 60).acquire()
    store = open_storage(root)
    staged = store.stage("ckpt-00000002")
    (staged / "state.json").write_text("{}")
    local = fetch_dir(store.publish(staged, "ckpt-00000002"))
    assert (local / "state.json").is_file() and len(list(downloads.iterdir())) == 1
    assert str(local.parent) in pins._held  # the fetch pinned its entry
    lease.release()
    assert list(downloads.iterdir()) == [] and not local.exists() and not pins._held


def test_six_runs_leave_the_cache_under_its_bound(capsys) -> None:
    """The measurement of app/storage/cache_use.py at 1/1000 scale: six runs of a 6 MiB checkpoint and a
    2 MiB export against a 25 MiB bound. The entries left are counted here from the RESULT line's own
    figures and checked against the sizes each run added (8 MiB each, 48 MiB in all)."""
    from app.storage.cache_use import main

    assert main(["--checkpoint-gb", str(6 / 1024), "--export-gb", str(2 / 1024), "--bound-gb", str(25 / 1024)]) == 0
    result = capsys.readouterr().out.strip().splitlines()[-1]
    fields = dict(part.split("=") for part in result.split()[1:])
    assert fields["entries"] == "6" and fields["within_bound"] == "True"
    mib = 1 << 20
    assert int(fields["bound_bytes"]) == int(25 / 1024 * (1 << 30))
    assert 24 * mib <= int(fields["cache_bytes"]) <= 24 * mib + 6 * 4096 <= int(fields["bound_bytes"])
    assert abs(int(fields["downloaded_bytes"]) - 48 * mib) < 64
