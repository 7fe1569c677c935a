"""Where a run's local files go for a local or a URI `checkpoint.dir` (app/storage/), and the users of
that one rule: fault markers (app/faults.py) and the tokenized-data cache (app/data/cache.py). No Ray."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from app.faults import fire_once
from app.storage.roots import is_uri, local_cache_dir, local_path

URI = "s3://bucket/runs/qwen?endpoint_override=127.0.0.1:9000&scheme=http"


@pytest.fixture
def tmp_temp_dir(tmp_path: Path, monkeypatch) -> Path:
    """tempfile.gettempdir() points into this test's folder."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    return temp


def test_a_local_root_is_its_own_folder(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert not is_uri(run) and local_path(run) == run and local_cache_dir(run) == run
    assert not run.exists()  # naming a local root creates nothing


def test_a_uri_root_gets_one_stable_folder_under_the_temp_dir(tmp_temp_dir: Path) -> None:
    import os

    assert is_uri(URI) and local_path(URI) is None
    first = local_cache_dir(URI)
    assert first.parent == tmp_temp_dir / f"dflash-{os.getuid()}" and first.name.startswith("qwen-") and first.is_dir()
    assert local_cache_dir(URI) == first  # a restarted process finds the same folder
    assert local_cache_dir("s3://bucket/runs/other") != first


def test_faults_fire_once_per_run_dir_local_and_uri(tmp_path: Path, tmp_temp_dir: Path) -> None:
    run = tmp_path / "run"
    assert [fire_once(run, "kill_target"), fire_once(run, "kill_target"), fire_once(run, "kill_pool")] == [True, False, True]
    assert sorted(p.name for p in (run / "faults_fired").iterdir()) == ["kill_pool", "kill_target"]
    assert [fire_once(URI, "kill_target"), fire_once(URI, "kill_target")] == [True, False]
    assert (local_cache_dir(URI) / "faults_fired" / "kill_target").is_file()
    assert fire_once("s3://bucket/runs/other", "kill_target")  # another run's markers are its own


@pytest.mark.parametrize("as_uri", [False, True])
def test_an_export_uploaded_over_an_older_one_leaves_none_of_its_files(tmp_path: Path, as_uri: bool) -> None:
    """An engine loads every *.safetensors in drafter/: an older run's shards must not outlive it."""
    from app.storage.roots import open_storage

    root = tmp_path / "run"
    store = open_storage(f"file://{root}" if as_uri else root)
    for name, data in (("config.json", b'{"v": 1}'), ("model-00001-of-00002.safetensors", b"old-1"),
                       ("model-00002-of-00002.safetensors", b"old-2"), ("model.safetensors.index.json", b"{}"),
                       ("extra/notes.txt", b"old")):
        store.write_file(f"drafter/{name}", data)
    new = tmp_path / "export"
    (new / "extra").mkdir(parents=True)
    (new / "config.json").write_text('{"v": 2}')
    (new / "model.safetensors").write_bytes(b"weights-2")
    (new / "extra" / "tokenizer.json").write_text("{}")
    store.upload_dir(new, "drafter", last="config.json")
    assert store.files("drafter") == ["config.json", "extra/tokenizer.json", "model.safetensors"]
    assert store.read_file("drafter/config.json") == b'{"v": 2}'
    assert store.files("nothing-here") == []
