"""Issue 35 H5: a transient storage error (an object store's 5xx, SlowDown) during a save or a resume is tried
again by the S3 client itself, with a bounded number of tries; anything else is raised at once. The real pyarrow
S3 client talks to moto through a front that answers chosen requests with S3 errors (tests/s3_server.py
`FaultyFront`); the front counts the requests, not the client. No Ray."""
from __future__ import annotations

import pytest
import torch

from app.storage import fence, uri_storage
from app.training.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint


@pytest.fixture(scope="module")
def front(s3):
    from tests.s3_server import FaultyFront

    f = FaultyFront(s3)
    yield f
    f.stop()


@pytest.fixture
def root(front, monkeypatch, request) -> str:
    monkeypatch.setattr(fence, "_mine", {})
    front.fail("PUT", 0)
    return front.uri(request.node.name.replace("[", "-").rstrip("]"))


def _state(step: int) -> TrainState:
    return TrainState(step=step, epoch=0, ledger=[1, 2, 5], drafter={"w": torch.arange(6, dtype=torch.float32)},
                      optimizer={"state": {}, "param_groups": []}, scheduler={}, rng=None)


@pytest.mark.slow  # the client's backoff waits for real: a few seconds
def test_a_save_outlives_two_slow_downs(front, root: str) -> None:
    front.fail("PUT", 2)  # the first two PUTs (an upload's first part) answered 503 SlowDown
    where = save_checkpoint(root, _state(3), keep=2)
    assert front.faults["PUT"][0] == 0 and front.tries["PUT"] >= 3  # both served, and the PUT made again
    assert str(latest_checkpoint(root)) == str(where)
    assert load_checkpoint(where).ledger == [1, 2, 5]


def test_a_resume_outlives_a_500(front, root: str) -> None:
    where = save_checkpoint(root, _state(4), keep=2)
    front.fail("GET", 1, 500, "InternalError")
    state = load_checkpoint(where)
    assert front.faults["GET"][0] == 0
    assert (state.step, state.ledger) == (4, [1, 2, 5]) and torch.equal(state.drafter["w"], torch.arange(6.0))


def test_a_listing_outlives_a_slow_down(front, root: str) -> None:
    save_checkpoint(root, _state(5), keep=2)
    front.fail("GET", 1)  # the listing's ListObjectsV2 is a GET
    assert latest_checkpoint(root).name == "ckpt-00000005" and front.faults["GET"][0] == 0


def test_retries_are_bounded(front, root: str, monkeypatch) -> None:
    """S3_ATTEMPTS tries of a request, then the error (2 here: the real 5 take ~10 s of backoff)."""
    monkeypatch.setattr(uri_storage, "S3_ATTEMPTS", 2)
    front.fail("PUT", 100)
    with pytest.raises(OSError, match="SLOW_DOWN"):
        uri_storage.UriStorage(root).write_file("x.json", b"{}")
    assert front.tries["PUT"] == 2


@pytest.mark.parametrize("status, code", [(403, "AccessDenied"), (400, "InvalidArgument")])
def test_other_errors_are_raised_at_once(front, root: str, status: int, code: str) -> None:
    store = uri_storage.UriStorage(root)
    front.fail("PUT", 1, status, code)
    with pytest.raises(OSError):
        store.write_file("x.json", b"{}")
    assert front.tries["PUT"] == 1


def test_s3_and_gcs_filesystems_get_their_retry_and_keep_their_options(s3) -> None:
    """The S3 filesystem is opened again with the options `from_uri` resolved (endpoint, scheme, region); GCS's
    retry is bounded at GCS_RETRY_S (pyarrow reports it back; S3's strategy it does not, the bound test above
    counts it)."""
    from datetime import timedelta

    from pyarrow.fs import GcsFileSystem, S3FileSystem

    fs, base = uri_storage.filesystem(s3.uri("opts"))
    options = fs.__reduce__()[1][0]
    assert isinstance(fs, S3FileSystem) and base == f"{s3.bucket}/opts"
    assert (options["endpoint_override"], options["scheme"], options["region"]) == (s3.endpoint, "http", "us-east-1")
    gcs, _ = uri_storage.filesystem("gs://bucket/run")
    assert isinstance(gcs, GcsFileSystem)
    assert gcs.__reduce__()[1][0]["retry_time_limit"] == timedelta(seconds=uri_storage.GCS_RETRY_S)
    local = uri_storage.filesystem("file:///tmp/x")[0]
    assert local.type_name == "local"
