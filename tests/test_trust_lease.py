"""Issue 35: a lease two drivers cannot both win, and writers fenced. The S3 cases run the real boto3
and pyarrow clients against the moto server of tests/s3_server.py; no Ray.

moto checks `If-None-Match` / `If-Match` and then stores the object in two steps of a threaded server;
S3 does both at once. `atomic_puts` (tests/conftest.py) gives moto that atomicity, so the tests race the lease,
not moto.
"""
from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest

from app.run.lease import LEASE_FILE, LeaseHeld, RunLease
from app.storage import fence
from app.storage.roots import open_storage
from tests.helpers import race, storage_root

TAKERS = 8


class WorstOrder:
    """The interleaving that beats a read / write / read-back lease: every taker reads the lease (none
    there) before any writes, then one at a time each writes it and reads it back (its own). Applied
    to the pyarrow storage the old lease went through, in the racing threads only."""

    def __init__(self, monkeypatch) -> None:
        from app.storage.uri_storage import UriStorage

        self.reads, self.turn, self.local = threading.Barrier(TAKERS), threading.Lock(), threading.local()
        real_read, real_write = UriStorage.read_file, UriStorage.write_file

        def read_file(store, rel):
            data = real_read(store, rel)
            if rel == LEASE_FILE and getattr(self.local, "racing", False):
                self.local.reads = getattr(self.local, "reads", 0) + 1
                if self.local.reads == 1:
                    self.reads.wait(timeout=30)  # nobody has written yet
                elif self.local.reads == 2 and self.turn.locked():
                    self.turn.release()  # read back: the next taker may write
            return data

        def write_file(store, rel, data):
            if rel == LEASE_FILE and getattr(self.local, "racing", False) and getattr(self.local, "reads", 0) == 1:
                self.turn.acquire(timeout=60)
            return real_write(store, rel, data)

        monkeypatch.setattr(UriStorage, "read_file", read_file)
        monkeypatch.setattr(UriStorage, "write_file", write_file)


def test_of_eight_drivers_starting_at_once_exactly_one_takes_the_s3_lease(s3, atomic_puts, monkeypatch) -> None:
    """Before: read, write, read back; in the worst order (`WorstOrder`) all 8 took the lease. Now a
    create-if-absent: one winner, seven one-line refusals, fencing token 1."""
    root = s3.uri(f"race-{uuid.uuid4().hex[:6]}")
    order = WorstOrder(monkeypatch)
    won, lost = race(lambda: RunLease(root, 60), RunLease.acquire, LeaseHeld, TAKERS,
                     ready=lambda: setattr(order.local, "racing", True))
    assert (len(won), len(lost)) == (1, TAKERS - 1)
    assert all("another run holds" in str(e) and "\n" not in str(e) for e in lost)
    assert won[0].held() and won[0].token == 1
    won[0].release()
    again = RunLease(root, 60).acquire()  # free once released; the counter only grows
    assert again.token == 2
    again.release()


def test_of_eight_takers_of_a_stale_s3_lease_exactly_one_wins_and_the_old_holder_learns_it(s3, atomic_puts) -> None:
    root = s3.uri(f"stale-{uuid.uuid4().hex[:6]}")
    now = [1000.0]
    old = RunLease(root, 60, clock=lambda: now[0]).acquire()
    now[0] += 61  # no heartbeat for longer than the timeout
    won, lost = race(lambda: RunLease(root, 60, clock=lambda: now[0]), RunLease.acquire, LeaseHeld, TAKERS)
    assert (len(won), len(lost)) == (1, TAKERS - 1)
    assert won[0].taken_over["run_id"] == old.me["run_id"] and won[0].token == old.token + 1
    assert old.beat() is False and won[0].held()  # its heartbeat never overwrites the new holder's lease
    assert won[0].beat() is True
    won[0].release()


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_run_that_lost_its_lease_cannot_publish(kind: str, tmp_path: Path, request, monkeypatch) -> None:
    """Driver A holds the lease; its rank 0 (another process: its own token table) writes its probe,
    so it writes under A's token. A is stopped long enough for run B to take the lease over. A's rank 0
    then publishes a checkpoint: refused (`FencedOut`), and B's rank publishes. Before: the lease
    guarded the driver only and A's rank 0 kept publishing into B's folder."""
    root = storage_root(kind, tmp_path, request, "fenced")
    now = [1000.0]
    driver_a, rank_a, rank_b = {}, {}, {}  # each process's tokens
    monkeypatch.setattr(fence, "_mine", driver_a)
    a = RunLease(root, 60, clock=lambda: now[0]).acquire()
    monkeypatch.setattr(fence, "_mine", rank_a)
    store = open_storage(root)
    store.write_file(".dflash-probe-0123456789ab", b"a")  # the group start: rank 0 of run A
    _publish(store, tmp_path, "ckpt-00000002")  # still A's folder: fine

    now[0] += 61  # A's driver stopped: no heartbeat
    monkeypatch.setattr(fence, "_mine", {})
    b = RunLease(root, 60, clock=lambda: now[0]).acquire()
    assert (a.token, b.token) == (1, 2)

    monkeypatch.setattr(fence, "_mine", rank_a)
    with pytest.raises(fence.FencedOut, match="fencing token 2, this run's is 1"):
        _publish(open_storage(root), tmp_path, "ckpt-00000004")
    with pytest.raises(fence.FencedOut):
        open_storage(root).upload_dir(_folder(tmp_path / "export"), "drafter", last="config.json")
    monkeypatch.setattr(fence, "_mine", rank_b)
    open_storage(root).write_file(".dflash-probe-0123456789ac", b"b")
    _publish(open_storage(root), tmp_path, "ckpt-00000004")
    assert sorted(e.name for e in open_storage(root).entries("ckpt-")) == ["ckpt-00000002", "ckpt-00000004"]


def _folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    return path


def _publish(store, tmp_path: Path, name: str) -> None:
    staged = store.stage(name)
    (staged / "state.json").write_text("{}")
    store.publish(staged, name)


def test_a_root_no_lease_touched_is_not_fenced(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(fence, "_mine", {})
    _publish(open_storage(tmp_path), tmp_path, "ckpt-00000001")
    assert fence.current(open_storage(tmp_path)) == 0 and not (tmp_path / fence.FENCE_FILE).exists()
    assert not (tmp_path / LEASE_FILE).exists()


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_lease_that_looks_stale_only_by_another_host_s_clock_is_not_taken(kind: str, tmp_path: Path, request) -> None:
    """A holder on another host whose clock runs 61 s behind ours: its heartbeat looks older than the
    60 s timeout. The taker watches the lease for a heartbeat period (15 s + 5 s) on its own clock; the
    live holder rewrites it meanwhile, so the start is refused. A holder that wrote nothing while watched
    is gone: its lease is taken. Before: taken at once, from a live run."""
    import json

    root = storage_root(kind, tmp_path, request, "skew")
    store = open_storage(root)
    holder = {"host": "node-7", "pid": 4242, "run_id": "live", "heartbeat": 1000.0 - 61}
    store.write_file(LEASE_FILE, json.dumps(holder).encode())
    waits: list[float] = []

    def holder_beats(seconds: float) -> None:
        waits.append(seconds)
        store.write_file(LEASE_FILE, json.dumps({**holder, "heartbeat": holder["heartbeat"] + 15}).encode())

    with pytest.raises(LeaseHeld, match="host node-7, pid 4242"):
        RunLease(root, 60, clock=lambda: 1000.0, sleep=holder_beats).acquire()
    assert waits == [20.0]
    lease = RunLease(root, 60, clock=lambda: 1100.0, sleep=waits.append).acquire()  # silent since: gone
    assert lease.taken_over["run_id"] == "live" and waits == [20.0, 20.0] and lease.held()
    lease.release()
