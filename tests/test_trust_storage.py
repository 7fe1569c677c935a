"""Issue 22, storage trust: a bucket writer cannot write the node (item 11), two runs cannot share one
checkpoint.dir (item 2), exports are never torn (item 5), a URI run keeps its timeline (item 7), the
driver and rank 0 see one folder (item 3), per-user caches (item 15).

The traversal tests use the real pyarrow S3 client against moto's server on loopback; the second-run
test runs two real driver processes (marked ray, slow).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from pyarrow.fs import FileSelector

from app.storage import MARKER, fetch_dir, open_storage, safe_destination


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("moto", reason="moto[server] is a dev dependency (pip install -e .[dev])")
    from tests.s3_server import start_s3_server, use_test_credentials

    use_test_credentials()
    server, s3 = start_s3_server()
    yield s3
    server.stop()


# ---- item 11: path traversal from the bucket ------------------------------------------------------

def _put(fs, path: str, data: bytes) -> None:
    with fs.open_output_stream(path) as out:
        out.write(data)


def _put_raw(s3, key: str, data: bytes) -> None:
    """An object under exactly `key`: boto3 sends it unnormalized (pyarrow and curl collapse `..`),
    as a hostile bucket writer would."""
    import boto3

    boto3.client("s3", endpoint_url=f"http://{s3.endpoint}", region_name="us-east-1").put_object(
        Bucket=s3.bucket, Key=key, Body=data)


@pytest.mark.parametrize("evil", ["../../{name}", "../../../{name}", "a/../../../{name}", "a//{name}", "./{name}"])
def test_fetch_refuses_a_bucket_key_that_leaves_the_download(s3, tmp_path: Path, monkeypatch, evil: str) -> None:
    """Item 11: an object key with `..` (or an empty / `.` part) written straight into the bucket is
    refused and nothing lands outside the download folder. Before: `../../x` (with `x` also in the
    bucket, where the HTTP client's normalized GET reads it) was written two folders above the download."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))  # every download folder under tmp_path
    (tmp_path / "tmp").mkdir()
    name = f"pwned-{abs(hash(evil)) % 10**8}.txt"
    prefix = f"trav-{abs(hash(evil)) % 10**8}/ckpt-00000001/v-0123456789ab"
    _put_raw(s3, f"{prefix}/state.json", b"{}")
    _put_raw(s3, f"{prefix}/{evil.format(name=name)}", b"owned")
    _put_raw(s3, __import__("posixpath").normpath(f"{prefix}/{evil.format(name=name)}"), b"owned")
    keys = [i.path for i in s3.filesystem().get_file_info(FileSelector(f"{s3.bucket}/{prefix}", recursive=True))]
    assert f"{s3.bucket}/{prefix}/{evil.format(name=name)}" in keys  # pyarrow lists the key as written
    with pytest.raises(ValueError, match="refusing to download"):
        fetch_dir(s3.uri(prefix), cache=False)
    assert list(tmp_path.rglob(name)) == []


def test_fetch_still_downloads_an_honest_version(s3) -> None:
    fs = s3.filesystem()
    prefix = f"{s3.bucket}/honest/ckpt-00000001/v-0123456789ab"
    _put(fs, f"{prefix}/state.json", b"{}")
    _put(fs, f"{prefix}/sub/w.bin", b"12")
    local = fetch_dir(s3.uri(prefix[len(s3.bucket) + 1:]), cache=False)
    assert sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()) == ["state.json", "sub/w.bin"]


def test_a_marker_naming_no_version_publishes_nothing(s3) -> None:
    """Item 11: COMMITTED must name a version (`v-` + 12 hex); `../../elsewhere` is not one."""
    fs = s3.filesystem()
    _put(fs, f"{s3.bucket}/marker/ckpt-00000002/v-0123456789ab/state.json", b"{}")
    _put(fs, f"{s3.bucket}/marker/ckpt-00000002/{MARKER}", b"../../other-run/ckpt-9/v-0123456789ab")
    _put(fs, f"{s3.bucket}/marker/ckpt-00000003/v-0123456789ab/state.json", b"{}")
    _put(fs, f"{s3.bucket}/marker/ckpt-00000003/{MARKER}", b"v-0123456789ab\n")
    assert [e.name for e in open_storage(s3.uri("marker")).entries("ckpt-")] == ["ckpt-00000003"]


def test_a_local_dir_through_a_file_uri_is_checked_too(tmp_path: Path) -> None:
    """Item 11 on a local dir (`file://`): a marker with a path in it is refused, keys are checked."""
    root = tmp_path / "run"
    (root / "ckpt-00000001" / "v-0123456789ab").mkdir(parents=True)
    (root / "ckpt-00000001" / MARKER).write_text("../../../etc")
    assert open_storage(f"file://{root}").entries("ckpt-") == []
    (root / "ckpt-00000001" / MARKER).write_text("v-0123456789ab")
    assert [e.name for e in open_storage(f"file://{root}").entries("ckpt-")] == ["ckpt-00000001"]
    folder = tmp_path / "dl"
    folder.mkdir()
    (folder / "link").symlink_to(tmp_path / "outside", target_is_directory=True)
    for key in ["base/../x", "base//x", "base/./x", "other/x", "base/link/x"]:
        with pytest.raises(ValueError, match="refusing to download"):
            safe_destination(folder, key, "base")
    assert safe_destination(folder, "base/a/b.txt", "base") == folder / "a" / "b.txt"
