"""Issue 35 H5: a transient storage error (an object store's 5xx, a transfer cut short) during a save or a
resume is tried again with a bounded backoff and one line per retry, never ends the save or the resume.
A fake filesystem over a real file:// root fails twice, then works; the waits go to a virtual clock
(no real sleeping). No Ray, no network."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.storage import fence, retry, uri_storage
from app.training.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint

SLOW_DOWN = ("When uploading part for key 'run/ckpt-00000003/v-0123456789ab/trainer.pt' in bucket 'b': AWS Error "
             "SLOW_DOWN during UploadPart operation: Please reduce your request rate.")
UNAVAILABLE = "When reading information for key 'run/x': AWS Error UNKNOWN (HTTP status 503) during HeadObject operation"


class Flaky:
    """A pyarrow filesystem whose `method` raises `error` on its first `failures` calls, then works."""

    def __init__(self, raw, method: str, failures: int, error: str) -> None:
        self.raw, self.method, self.left, self.error, self.calls = raw, method, failures, error, 0

    def __getattr__(self, name: str):
        value = getattr(self.raw, name)
        if name != self.method:
            return value

        def call(*args, **kwargs):
            self.calls += 1
            if self.left > 0:
                self.left -= 1
                raise OSError(self.error)
            return value(*args, **kwargs)

        return call


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(retry, "sleep", slept.append)  # virtual: nothing waits for real
    monkeypatch.setattr(fence, "_mine", {})
    return slept


def _flaky(monkeypatch, method: str, failures: int, error: str = SLOW_DOWN) -> list[Flaky]:
    made: list[Flaky] = []
    real = uri_storage._from_uri

    def from_uri(uri: str):
        fs, base = real(uri)
        made.append(Flaky(fs, method, failures, error))
        return made[-1], base

    monkeypatch.setattr(uri_storage, "_from_uri", from_uri)
    return made


def _state(step: int) -> TrainState:
    return TrainState(step=step, epoch=0, ledger=[1, 2, 5], drafter={"w": torch.arange(6, dtype=torch.float32)},
                      optimizer={"state": {}, "param_groups": []}, scheduler={}, rng=None)


def test_a_save_outlives_two_slow_downs(tmp_path: Path, monkeypatch, waits, capsys) -> None:
    root = f"file://{tmp_path / 'run'}"
    made = _flaky(monkeypatch, "open_output_stream", failures=2)
    where = save_checkpoint(root, _state(3), keep=2)
    assert sum(f.calls for f in made) >= 3 and waits == [0.5, 2.0]
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("storage:")]
    assert len(lines) == 2 and "(SLOW_DOWN), attempt 1 of 4; trying again in 0.5 s" in lines[0]
    assert "attempt 2 of 4; trying again in 2 s" in lines[1]
    monkeypatch.undo()
    assert str(latest_checkpoint(root)) == str(where)
    assert load_checkpoint(where).ledger == [1, 2, 5]


def test_a_resume_outlives_two_503s(tmp_path: Path, monkeypatch, waits) -> None:
    root = f"file://{tmp_path / 'run'}"
    where = save_checkpoint(root, _state(4), keep=2)
    _flaky(monkeypatch, "open_input_stream", failures=2, error=UNAVAILABLE)
    state = load_checkpoint(where)
    assert (state.step, state.ledger) == (4, [1, 2, 5]) and torch.equal(state.drafter["w"], torch.arange(6.0))
    assert waits == [0.5, 2.0]


def test_a_listing_outlives_a_cut_connection(tmp_path: Path, monkeypatch, waits) -> None:
    root = f"file://{tmp_path / 'run'}"
    save_checkpoint(root, _state(5), keep=2)
    _flaky(monkeypatch, "get_file_info", failures=1, error="AWS Error NETWORK_CONNECTION during ListObjectsV2 "
                                                             "operation: curlCode: 56, Failure when receiving data from the peer")
    assert latest_checkpoint(root).name == "ckpt-00000005" and waits == [0.5]


def test_retries_are_bounded(tmp_path: Path, monkeypatch, waits) -> None:
    _flaky(monkeypatch, "open_output_stream", failures=100)
    with pytest.raises(OSError, match="SLOW_DOWN"):
        save_checkpoint(f"file://{tmp_path / 'run'}", _state(6), keep=2)
    assert waits == [0.5, 2.0, 8.0]  # 4 attempts, about 10 s of waiting in all


@pytest.mark.parametrize("error", [
    FileNotFoundError(2, "No such file"),
    PermissionError(13, "denied"),
    OSError("AWS Error ACCESS_DENIED during PutObject operation: Access Denied"),
    OSError("AWS Error NETWORK_CONNECTION during HeadBucket operation: curlCode: 7, Could not connect to server"),
    OSError("no such key run/ckpt-00000503/state.json"),  # a 503 inside a name is no status
    ValueError("refusing to download object 'run/../x'"),
])
def test_other_errors_are_raised_at_once(error: Exception, waits) -> None:
    calls = []

    def fail():
        calls.append(1)
        raise error

    with pytest.raises(type(error)):
        retry.retried(fail, "write of x")
    assert calls == [1] and waits == []


@pytest.mark.parametrize("error, kind", [
    (OSError(SLOW_DOWN), "SLOW_DOWN"),
    (OSError(UNAVAILABLE), "HTTP status 503"),
    (OSError("GCS: InternalError: backend error"), "InternalError"),
    (OSError("curlCode: 28, Timeout was reached"), "curlCode: 28"),
    (TimeoutError(110, "timed out"), "ETIMEDOUT"),
    (ConnectionResetError(104, "reset"), "ECONNRESET"),
])
def test_transient_kinds(error: Exception, kind: str) -> None:
    assert retry.transient_kind(error) == kind
