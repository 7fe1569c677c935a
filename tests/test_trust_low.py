"""Issue 35, the low items: start-up cleanup removes only names this project writes; URI credentials
are hidden up to the host (a password holding `@`); a bad checkpoint.dir is one line before anything
and the lease never creates a bucket; the per-user cache folder."""
from __future__ import annotations

import os
from pathlib import Path

import pytest


# ---- start-up cleanup: a fixed prefix -----------------------------------------------------------------

def test_start_up_cleanup_leaves_a_user_s_tmp_and_old_files_alone(tmp_path: Path) -> None:
    """A user's `notes.tmp-1`, `results.old-2/`, `.tmp-mine/` and `.old-mine/` beside a run stay; the
    staging, set-aside and probe names the project writes go (or come back). Before: every name
    holding `.tmp-` or `.old-` was deleted."""
    from app.storage.publish import LocalStorage
    from app.training.checkpoint import clean_orphans

    user = ["notes.tmp-1", "results.old-2", ".tmp-mine", ".old-mine", ".probe-mine", "a.dflash-tmp-x"]
    (tmp_path / "notes.tmp-1").write_text("mine")
    for name in user[1:]:
        (tmp_path / name).mkdir()
    store = LocalStorage(tmp_path)
    staged = store.stage("ckpt-00000006")  # a crash mid-save leaves it
    assert staged.name.startswith(".dflash-tmp-ckpt-00000006-")
    ours = store.stage("ckpt-00000004")
    (ours / "state.json").write_text("{}")
    store.publish(ours, "ckpt-00000004")
    (tmp_path / "ckpt-00000004").rename(tmp_path / ".dflash-old-ckpt-00000004")  # crashed between the renames
    (tmp_path / ".dflash-probe-0123456789ab").write_text("tok")
    done = clean_orphans(tmp_path)
    assert sorted(done) == [f"removed .dflash-probe-0123456789ab", f"removed {staged.name}", "restored ckpt-00000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(user + ["ckpt-00000004"])


def test_a_rewrite_sets_the_old_copy_aside_under_the_fixed_prefix(tmp_path: Path, monkeypatch) -> None:
    """Where the atomic exchange is unavailable, a rewrite renames the old copy to `.dflash-old-<name>`."""
    from app.storage import publish

    monkeypatch.setattr(publish, "exchange", lambda a, b: False)
    seen = []
    real_rename = Path.rename
    monkeypatch.setattr(Path, "rename", lambda self, to: seen.append(Path(to).name) or real_rename(self, to))
    store = publish.LocalStorage(tmp_path)
    for _ in range(2):
        store.publish(store.stage("drafter"), "drafter")
    assert ".dflash-old-drafter" in seen and sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


# ---- redaction up to the host ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, shown", [
    ("s3://AKIA:p@ss@bucket/run", "s3://***@bucket/run"),
    ("s3://AKIA:p@s@s/w+rd@bucket/run?scheme=http", "s3://***@bucket/run?scheme=http"),
    ("s3://AKIA:se/cr@et@bucket", "s3://***@bucket"),
    ("from s3://K:a@b@bucket/run and gs://t@ok@q/x", "from s3://***@bucket/run and gs://***@q/x"),
    ("s3://K:S@bucket/run@v2", "s3://***@v2"),  # which `@` ends a password is unknowable: hide more, never less
])
def test_a_password_holding_an_at_sign_is_hidden_up_to_the_host(text: str, shown: str) -> None:
    """Before: redaction stopped at the first `@`, so `s3://AKIA:p@ss@bucket` printed `ss@bucket`."""
    from app.storage.roots import has_credentials, redact

    assert redact(text) == shown and has_credentials(text) and redact(shown) == shown


# ---- a bad checkpoint.dir: one line, before anything; the lease never creates a bucket ------------------

def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


@pytest.mark.parametrize("root, says", [
    ("foo://bucket/run", "foo"),
    ("s3://bucket/run?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1", "NETWORK_CONNECTION"),
])
def test_a_bad_checkpoint_dir_is_one_line_before_anything(root: str, says: str, tmp_path: Path, monkeypatch,
                                                           capsys) -> None:
    """An unknown scheme and an S3 endpoint nobody answers: the driver stops with one line naming
    checkpoint.dir, exit 2, before planning (nothing tokenized, no cluster). Before: a pyarrow
    traceback out of the lease. (The S3 client retries a refused connection for ~6 s: its HeadBucket
    answer is stood in for here, as the real client words it, to keep the test fast.)"""
    from types import SimpleNamespace

    from app.config.load import load_config
    from app.run import driver
    from tests.s3_server import use_test_credentials

    use_test_credentials()

    def refused(path):
        raise OSError(f"When getting information for bucket {path!r}: AWS Error NETWORK_CONNECTION during HeadBucket "
                      "operation: curlCode: 7, Could not connect to server")

    if root.startswith("s3://"):
        unanswered = SimpleNamespace(base="bucket/run", fs=SimpleNamespace(type_name="s3", get_file_info=refused))
        monkeypatch.setattr("app.storage.roots.UriStorage", lambda root: unanswered)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(driver, "make_plan", lambda cfg: pytest.fail("planned despite a bad checkpoint.dir"))
    root = root.format(port=_closed_port())
    cfg = load_config(Path(__file__).resolve().parents[1] / "conf/tiny.yaml", [f"checkpoint.dir={root}"])
    assert driver.run(cfg) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("config error: checkpoint.dir=") and says in err, err


def test_the_lease_never_creates_a_bucket(s3) -> None:
    """A checkpoint.dir in a bucket that does not exist (the URI even allows bucket creation): refused in
    one line and the bucket is still absent. Before: the lease's create_dir made the bucket."""
    from pyarrow.fs import FileType

    from app.config.errors import ConfigError
    from app.run.lease import RunLease

    missing = f"{s3.bucket}-missing"
    uri = s3.uri("run").replace(s3.bucket, missing) + "&allow_bucket_creation=true"
    with pytest.raises(ConfigError, match=f"bucket '{missing}' does not exist") as err:
        RunLease(uri, 60).acquire()
    assert "\n" not in str(err.value)
    assert s3.filesystem().get_file_info(missing).type == FileType.NotFound
    lease = RunLease(s3.uri("run-ok"), 60).acquire()  # an existing bucket with no prefix yet is fine
    assert lease.held()
    lease.release()


def test_a_local_checkpoint_dir_under_a_file_is_one_line(tmp_path: Path) -> None:
    from app.config.errors import ConfigError
    from app.run.lease import RunLease

    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"checkpoint.dir=.*file/run: the folder cannot be created"):
        RunLease(tmp_path / "file" / "run", 60).acquire()


# ---- the per-user cache root ----------------------------------------------------------------------------

@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder of another owner needs root")
def test_a_cache_root_another_user_made_first_is_refused(tmp_path: Path, monkeypatch) -> None:
    """`<tmp>/dflash-<uid>` created first by another user (uid 65534 here) is refused, never used."""
    from app.storage.local_cache import cache_root

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    planted = tmp_path / f"dflash-{os.getuid()}"
    planted.mkdir(mode=0o777)
    os.chown(planted, 65534, 65534)
    with pytest.raises(RuntimeError, match="not a folder of this user"):
        cache_root()
    os.rmdir(planted)
    assert cache_root() == planted and (planted.stat().st_mode & 0o777, planted.stat().st_uid) == (0o700, os.getuid())


# ---- the download cache: unused entries go at the next start ------------------------------------------

def test_downloads_unused_for_days_are_removed_at_start(tmp_path: Path, monkeypatch) -> None:
    """A finished run's cached checkpoint versions and export stayed on every node forever (~25 GB a
    run). At start, download entries nobody used for DOWNLOAD_STALE_S go; a recent one, and anything
    not named as a download entry, stays."""
    import time

    from app.storage import local_cache

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    root = local_cache.cache_root()
    downloads = root / local_cache.DOWNLOADS
    downloads.mkdir()
    old, recent, other = downloads / "0123456789ab-aaaaaaaaaaaa", downloads / "0123456789ab-bbbbbbbbbbbb", downloads / "notes"
    for folder in (old, recent, other):
        (folder / "files").mkdir(parents=True)
        (folder / "files" / "w.bin").write_bytes(b"x" * 100)
    now = time.time()
    for folder in (old, other):
        os.utime(folder, (now - local_cache.DOWNLOAD_STALE_S - 60,) * 2)
    removed = local_cache.clean_stale(root, now=now)
    assert removed == [old.name] and not old.exists() and recent.is_dir() and other.is_dir()


# ---- issue 49, item 6: planted names refused, never a crash ------------------------------------------

@pytest.mark.parametrize("planted", [".dflash-old-.", ".dflash-old-.."])
def test_a_planted_aside_name_naming_the_folder_itself_is_left_alone(planted: str, tmp_path: Path) -> None:
    """`.dflash-old-.` would be put back as `.`: start-up cleanup leaves it (not a name the project writes)
    and goes on with the rest. Before: `ValueError` from `Path.with_name('.')`, and the run did not start."""
    from app.training.checkpoint import clean_orphans

    (tmp_path / planted).mkdir()
    (tmp_path / ".dflash-probe-0123456789ab").write_text("tok")
    assert clean_orphans(tmp_path) == ["removed .dflash-probe-0123456789ab"]
    assert (tmp_path / planted).is_dir()


def test_a_name_with_a_nul_is_refused_in_one_line(tmp_path: Path) -> None:
    """A listed name holding a NUL is skipped with the warning every name leaving the folder gets; a
    delete of one is a ValueError naming it. Before: `ValueError: embedded null byte` from deep in
    pathlib, out of the listing itself."""
    from app.storage.fetch import safe_destination
    from app.storage.names import inside, stays_inside
    from app.storage.roots import open_storage

    assert not stays_inside("ckpt-1\x00/x", tmp_path)
    with pytest.warns(UserWarning, match="skipping 1 listed name"):
        assert inside(["ckpt-1", "ckpt-2\x00"], tmp_path, ".") == ["ckpt-1"]
    with pytest.raises(ValueError, match="refusing to delete entry"):
        open_storage(tmp_path).delete("ckpt-2\x00")
    with pytest.raises(ValueError, match="refusing to download object"):
        safe_destination(tmp_path, "b/run/x\x00y", "b/run")
