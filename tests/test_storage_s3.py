"""Checkpoints on object storage: the real pyarrow S3 client against moto's S3 server on loopback.

The unit tests need no Ray; the last one runs the tiny training through the S3 server, stops it and
resumes from the checkpoint it finds there (marked ray, slow and cluster).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.training.checkpoint import TrainState, latest_checkpoint, list_checkpoints, load_checkpoint, read_ledger, \
    save_checkpoint
from app.storage.publish import MARKER
from app.storage.roots import open_storage, root_name

pytest.importorskip("moto", reason="moto[server] is a dev dependency (pip install -e .[dev])")


def _state(step: int, ledger: list[int] | None = None) -> TrainState:
    return TrainState(step=step, epoch=1, ledger=ledger if ledger is not None else [5, 3, step],
                      drafter={"w": torch.full((2, 2), float(step))}, optimizer={"lr": 0.1},
                      scheduler={"last_epoch": step}, rng=None, extra={"data_fingerprint": "abc"})


def _objects(s3, prefix: str) -> list[str]:
    from pyarrow.fs import FileSelector, FileType

    base = f"{s3.bucket}/{prefix}"
    infos = s3.filesystem().get_file_info(FileSelector(base, recursive=True, allow_not_found=True))
    return sorted(i.path[len(base) + 1:] for i in infos if i.type == FileType.File)


def test_rotation_and_round_trip_through_s3(s3) -> None:
    root = s3.uri("rotate")
    for step in (2, 4, 6, 8):
        save_checkpoint(root, _state(step), keep=2)
    assert [c.name for c in list_checkpoints(root)] == ["ckpt-00000006", "ckpt-00000008"]
    latest = latest_checkpoint(root)
    assert latest.startswith("s3://") and "endpoint_override=" in latest
    assert read_ledger(latest) == (8, 1, [3, 5, 8])
    state = load_checkpoint(latest)
    assert torch.equal(state.drafter["w"], torch.full((2, 2), 8.0)) and state.scheduler == {"last_epoch": 8}
    assert state.extra == {"data_fingerprint": "abc"}
    # Pruned checkpoints are gone from the bucket, marker and data alike.
    assert {o.split("/")[0] for o in _objects(s3, "rotate")} == {"ckpt-00000006", "ckpt-00000008"}


def test_rewriting_a_step_flips_the_marker_and_drops_the_old_version(s3) -> None:
    root = s3.uri("rewrite")
    save_checkpoint(root, _state(4), keep=1)
    save_checkpoint(root, _state(4, ledger=[1, 2]), keep=1)
    assert read_ledger(latest_checkpoint(root))[2] == [1, 2]
    objects = _objects(s3, "rewrite")
    versions = {o.split("/")[1] for o in objects if o.count("/") == 2}
    assert len(versions) == 1 and f"ckpt-00000004/{MARKER}" in objects
    assert len(objects) == 4  # marker + drafter.safetensors + trainer.pt + state.json


def test_unmarked_uploads_are_never_picked(s3) -> None:
    root = s3.uri("crash")
    save_checkpoint(root, _state(2), keep=3)
    fs = s3.filesystem()
    # A crash after uploading the files of step 4 but before its marker.
    with fs.open_output_stream(f"{s3.bucket}/crash/ckpt-00000004/v-deadbeef/state.json") as out:
        out.write(b'{"step": 4, "epoch": 1, "ledger": [], "extra": {}}')
    # A half-deleted checkpoint: marker gone, data left.
    with fs.open_output_stream(f"{s3.bucket}/crash/ckpt-00000006/v-cafe/state.json") as out:
        out.write(b'{"step": 6, "epoch": 1, "ledger": [], "extra": {}}')
    assert [c.name for c in list_checkpoints(root)] == ["ckpt-00000002"]
    assert read_ledger(latest_checkpoint(root))[0] == 2


def test_empty_bucket_prefix_has_no_checkpoint(s3) -> None:
    assert latest_checkpoint(s3.uri("nothing-here")) is None


def test_files_and_names_through_storage(s3, tmp_path: Path) -> None:
    store = open_storage(s3.uri("files"))
    assert store.read_file("summary.json") is None
    store.write_file("summary.json", b"{}")
    assert store.read_file("summary.json") == b"{}"
    assert root_name(s3.uri("runs/qwen")) == "qwen" and root_name(tmp_path / "x") == "x"


def test_export_folder_upload_is_plain_and_config_comes_last(s3, tmp_path: Path) -> None:
    from app.storage.fetch import fetch_dir

    local = tmp_path / "export"
    local.mkdir()
    (local / "config.json").write_text('{"v": 2}')
    (local / "model.safetensors").write_bytes(b"weights-2")
    store = open_storage(s3.uri("export"))
    store.write_file("drafter/config.json", b'{"v": 1}')  # an older export being replaced, sharded
    store.write_file("drafter/model-00001-of-00002.safetensors", b"old-1")
    store.write_file("drafter/model.safetensors.index.json", b"{}")
    location = store.upload_dir(local, "drafter", last="config.json")
    assert _objects(s3, "export") == ["drafter/config.json", "drafter/model.safetensors"]  # engines' layout
    fetched = fetch_dir(location, cache=False)
    assert (fetched / "config.json").read_text() == '{"v": 2}' and (fetched / "model.safetensors").read_bytes() == b"weights-2"


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.cluster
def test_tiny_run_checkpoints_to_s3_and_resumes_from_it(ray_cluster, s3, tmp_path: Path) -> None:
    import json

    from app.storage.fetch import fetch_dir
    from tests.e2e_helpers import SMALL, run_in_process, sigterm_and_wait, start_driver, wait_for

    root = s3.uri("tiny-run")
    # One epoch on 2 / 2; the drafter delay keeps the first driver training for at least 15 x 1 s after its
    # first checkpoint (step 2 of 17), whatever the machine's speed: the SIGTERM stops a run mid-way.
    proc = start_driver(tmp_path, *SMALL, f"checkpoint.dir={root}", "checkpoint.every_steps=2", "logging.run_name=s3run",
                        "faults.drafter_delay_s=1")
    wait_for(lambda: latest_checkpoint(root) is not None, 900, "a first checkpoint in the S3 bucket")
    code, out = sigterm_and_wait(proc, timeout=300)
    assert code == 0, out
    step1, _, ledger1 = read_ledger(latest_checkpoint(root))
    assert step1 > 0 and ledger1

    assert run_in_process(tmp_path, *SMALL, f"checkpoint.dir={root}", "logging.run_name=s3run") == 0
    summary = json.loads(open_storage(root).read_file("summary.json"))
    assert summary["resumed_from_step"] == step1
    assert summary["jobs_acked"] == summary["jobs_scheduled"] and summary["jobs_acked_twice"] == 0
    assert summary["jobs_trained_this_run"] == summary["jobs_scheduled"] - len(ledger1)
    final = read_ledger(latest_checkpoint(root))[2]
    assert len(final) == len(set(final)) == summary["jobs_scheduled"] and set(ledger1) <= set(final)
    assert summary["tau_trained"] is not None
    config = json.loads((fetch_dir(open_storage(root).location("drafter"), cache=False) / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
