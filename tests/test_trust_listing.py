"""Issue 35, first item: a remote listing is hostile input. Every name it returns must stay inside the
folder listed (no `..`, no empty, `.` or absolute part, no symlink leaving it on `file://`) before
anything is deleted or downloaded; a name that leaves is skipped with a warning (a sweep) or refused
(a download). Before, the export's stale-file sweep deleted whatever the listing named.

The S3 cases put hostile keys into the loopback moto bucket with boto3 (pyarrow collapses `..` on
write, a hand-written key does not); the `file://` cases build a real folder with a symlink out.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from app.storage.names import stays_inside
from app.storage.publish import MARKER
from app.storage.roots import open_storage


def _export(tmp_path: Path) -> Path:
    local = tmp_path / "export"
    local.mkdir()
    (local / "config.json").write_text('{"v": 2}')
    (local / "model.safetensors").write_bytes(b"weights-2")
    return local


def _outside(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.safetensors").write_bytes(b"keep me")
    return outside


@pytest.mark.parametrize("as_uri", [True, False], ids=["file-uri", "path"])
def test_the_export_sweep_never_deletes_through_a_symlink_out_of_the_folder(tmp_path: Path, as_uri: bool) -> None:
    """An old export folder holding a symlinked sub-folder and a symlinked file that point out of it:
    the sweep of stale files removes the honest stale shard only, warns about both links, and the
    files they point at stay. Before: on `file://` pyarrow's listing walked through the folder link and
    the sweep deleted `outside/victim.safetensors`; a plain path removed the file link without a word."""
    outside = _outside(tmp_path)
    folder = tmp_path / "run" / "drafter"
    folder.mkdir(parents=True)
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"old shard")
    (folder / "shards").symlink_to(outside, target_is_directory=True)
    (folder / "linked.safetensors").symlink_to(outside / "victim.safetensors")
    root = f"file://{tmp_path / 'run'}" if as_uri else tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        open_storage(root).upload_dir(_export(tmp_path), "drafter", last="config.json")
    assert (outside / "victim.safetensors").read_bytes() == b"keep me"
    assert not (folder / "model-00001-of-00002.safetensors").exists()  # an honest stale file still goes
    assert (folder / "config.json").read_text() == '{"v": 2}'
    lines = [str(w.message) for w in caught if "leave" in str(w.message)]
    assert len(lines) == 1 and "linked.safetensors" in lines[0], lines


def _put_raw(s3, key: str, data: bytes, bucket: str | None = None) -> None:
    """An object under exactly `key` (boto3 sends it unnormalized, as a hostile bucket writer would)."""
    import boto3

    boto3.client("s3", endpoint_url=f"http://{s3.endpoint}", region_name="us-east-1").put_object(
        Bucket=bucket or s3.bucket, Key=key, Body=data)


def _exists(s3, path: str) -> bool:
    from pyarrow.fs import FileType

    return s3.filesystem().get_file_info(path).type == FileType.File


def test_the_export_sweep_never_follows_a_bucket_key_out_of_the_folder(s3, tmp_path: Path) -> None:
    """Keys `drafter/../victim` and `drafter/../../../<other bucket>/victim` in the bucket: the sweep
    skips them with a warning; the objects their normalized paths name, elsewhere in this bucket and in
    another bucket, stay. Before: both were deleted (the listing's name, normalized by the client)."""
    other = f"{s3.bucket}-other"
    s3.filesystem().create_dir(other)
    _put_raw(s3, "sweep/victim.bin", b"mine")
    _put_raw(s3, "victim.bin", b"theirs", bucket=other)
    _put_raw(s3, "sweep/drafter/../victim.bin", b"bait")
    _put_raw(s3, f"sweep/drafter/../../../{other}/victim.bin", b"bait")
    _put_raw(s3, "sweep/drafter/model-00001-of-00002.safetensors", b"old shard")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        open_storage(s3.uri("sweep")).upload_dir(_export(tmp_path), "drafter", last="config.json")
    assert _exists(s3, f"{s3.bucket}/sweep/victim.bin") and _exists(s3, f"{other}/victim.bin")
    assert not _exists(s3, f"{s3.bucket}/sweep/drafter/model-00001-of-00002.safetensors")
    assert any("../victim.bin" in str(w.message) for w in caught)


def test_a_version_sweep_and_checkpoint_entries_skip_symlinks_out_of_the_root(tmp_path: Path) -> None:
    """`file://` checkpoints: a planted `ckpt-*` link to another folder is no entry (never read, never
    pruned), and a planted `v-*` link beside a published version is never swept into."""
    outside = _outside(tmp_path)
    (outside / MARKER).write_text("v-0123456789ab")
    (outside / "v-0123456789ab").mkdir()
    root = tmp_path / "run"
    root.mkdir()
    (root / "ckpt-00000009").symlink_to(outside, target_is_directory=True)
    with pytest.warns(UserWarning, match="leave"):
        assert open_storage(f"file://{root}").entries("ckpt-") == []
    (root / "ckpt-00000001").mkdir()
    (root / "ckpt-00000001" / "v-aaaaaaaaaaaa").symlink_to(outside, target_is_directory=True)
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "state.json").write_text("{}")
    with pytest.warns(UserWarning, match="leave"):
        open_storage(f"file://{root}").publish(staged, "ckpt-00000001")
    assert (outside / "victim.safetensors").read_bytes() == b"keep me"


def test_a_file_uri_download_refuses_a_symlink_out_of_the_source(tmp_path: Path, monkeypatch) -> None:
    """Downloading a `file://` folder with a link to a file outside it is refused (it would copy any
    file the process can read into the node's cache); before, the target file was copied."""
    from app.storage.fetch import fetch_dir

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    outside = _outside(tmp_path)
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").symlink_to(outside / "victim.safetensors")
    with pytest.raises(ValueError, match="refusing to download"):
        fetch_dir(f"file://{src}", cache=False)
    assert [p for p in (tmp_path / "tmp").rglob("*") if p.is_file() and p.read_bytes() == b"keep me"] == []


@pytest.mark.parametrize("name,ok", [
    ("a.bin", True), ("sub/a.bin", True), ("../a.bin", False), ("sub/../../a", False), ("/etc/passwd", False),
    ("", False), ("a//b", False), ("./a", False), ("a\\..\\b", False), ("sub/..", False)])
def test_listed_names_are_checked_by_their_parts(name: str, ok: bool) -> None:
    assert stays_inside(name) is ok


def test_a_symlink_inside_the_folder_that_stays_inside_is_fine(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "a").write_text("x")
    (tmp_path / "alias").symlink_to(tmp_path / "real", target_is_directory=True)
    (tmp_path / "out").symlink_to(tmp_path.parent, target_is_directory=True)
    assert stays_inside("alias/a", tmp_path) and not stays_inside("out/a", tmp_path)
