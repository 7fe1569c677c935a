"""Issue 35: the gs:// run lease is taken with GCS's generation preconditions, so two drivers cannot both
win it. No GCS emulator is installed, so a loopback server answers the three JSON API calls the lease
makes, with GCS's rules (documented at cloud.google.com/storage/docs/request-preconditions): a media
upload with `ifGenerationMatch=0` only when no object is there, with `ifGenerationMatch=<n>` only when
generation n is live, else 412; an object's metadata names its live generation, and a media download
with `generation=<n>` gives that generation's bytes (404 once it is replaced).
The lease logic itself (RunLease, as for s3://) runs unchanged. No Ray, no network beyond loopback."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from app.run.lease import LEASE_FILE, LeaseHeld, RunLease
from app.storage.conditional import GcsConditionalStore, conditional_store
from tests.helpers import race

TAKERS = 8


class FakeGcs(BaseHTTPRequestHandler):
    objects: dict[tuple[str, str], tuple[bytes, int]] = {}
    lock = threading.Lock()
    generation = [1000]

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, code: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _object(self) -> tuple[str, str]:
        parts = urlsplit(self.path).path.split("/")  # /storage/v1/b/<bucket>/o/<key>
        return unquote(parts[4]), unquote(parts[6])

    def do_POST(self) -> None:  # /upload/storage/v1/b/<bucket>/o?uploadType=media&name=..&ifGenerationMatch=..
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        bucket, data = url.path.split("/")[5], self.rfile.read(int(self.headers["Content-Length"]))
        key = (bucket, query["name"])
        with self.lock:  # GCS checks the precondition and stores in one step
            live = self.objects.get(key)
            want = query.get("ifGenerationMatch")
            if want is not None and (live[1] if live else 0) != int(want):
                return self._send(412, b'{"error": {"code": 412, "message": "conditionNotMet"}}')
            self.generation[0] += 1
            self.objects[key] = (data, self.generation[0])
        self._send(200, json.dumps({"name": key[1], "generation": str(self.generation[0])}).encode())

    def do_GET(self) -> None:  # metadata, or with alt=media the bytes (of `generation` when given)
        query = {k: v[-1] for k, v in parse_qs(urlsplit(self.path).query).items()}
        with self.lock:
            found = self.objects.get(self._object())
        if found is None or ("generation" in query and int(query["generation"]) != found[1]):
            return self._send(404)
        if query.get("alt") == "media":
            return self._send(200, found[0])
        self._send(200, json.dumps({"generation": str(found[1])}).encode())

    def do_DELETE(self) -> None:  # with `ifGenerationMatch=<n>` only while generation n is live, else 412
        want = {k: v[-1] for k, v in parse_qs(urlsplit(self.path).query).items()}.get("ifGenerationMatch")
        with self.lock:
            found = self.objects.get(self._object())
            if found is not None and want is not None and found[1] != int(want):
                return self._send(412)
            self.objects.pop(self._object(), None)
        self._send(204 if found else 404)


@pytest.fixture(scope="module")
def gcs():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeGcs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _root(gcs: str, name: str) -> str:
    return f"gs://bucket/{name}?endpoint_override={gcs}&scheme=http"


def test_a_gs_root_gets_the_conditional_store() -> None:
    assert isinstance(conditional_store("gs://bucket/run"), GcsConditionalStore)
    assert conditional_store("hdfs://x/run") is None


def test_of_eight_drivers_starting_at_once_exactly_one_takes_the_gs_lease(gcs: str) -> None:
    """Before: gs:// took the read / write / read-back lease, which all eight could win in the worst order."""
    won, lost = race(lambda: RunLease(_root(gcs, "race"), 60), RunLease._acquire_conditional, LeaseHeld, TAKERS)
    assert (len(won), len(lost)) == (1, TAKERS - 1)
    assert all("another run holds" in str(e) for e in lost)
    assert won[0].beat() is True


def test_of_eight_takers_of_a_stale_gs_lease_exactly_one_wins_and_the_old_holder_learns_it(gcs: str) -> None:
    now = [1000.0]
    old = RunLease(_root(gcs, "stale"), 60, clock=lambda: now[0])
    old._acquire_conditional()
    now[0] += 61  # no heartbeat for longer than the timeout
    won, lost = race(lambda: RunLease(_root(gcs, "stale"), 60, clock=lambda: now[0]), RunLease._acquire_conditional,
                     LeaseHeld, TAKERS)
    assert (len(won), len(lost)) == (1, TAKERS - 1)
    assert won[0].taken_over["run_id"] == old.me["run_id"]
    assert old.beat() is False and won[0].beat() is True  # the old heartbeat never overwrites the new holder
    store = GcsConditionalStore(_root(gcs, "stale"))
    assert json.loads(store.read(LEASE_FILE).data)["run_id"] == won[0].me["run_id"]
    store.delete(LEASE_FILE)
    assert store.read(LEASE_FILE) is None and store.create(LEASE_FILE, b"{}") is not None


def test_a_paused_gs_release_leaves_the_new_holder_s_lease(gcs: str) -> None:
    """Issue 49: A's release pauses before it touches the lease object while B takes the stale lease
    over; A's release is conditional on its own generation, so it changes nothing and B keeps the lease.
    Before: release checked `held()`, then deleted B's lease unconditionally."""
    now = [1000.0]
    a = RunLease(_root(gcs, "paused"), 60, clock=lambda: now[0])
    a._acquire_conditional()
    b = RunLease(_root(gcs, "paused"), 60, clock=lambda: now[0])
    real = a._conditional

    class Paused:
        def __getattr__(self, name):
            def call(*args, **kwargs):
                if b._etag == "":
                    now[0] += 61
                    b._acquire_conditional()
                return getattr(real, name)(*args, **kwargs)
            return call

    a._conditional = Paused()
    a.held = lambda: True  # what A saw just before the pause (the code before this change asked it first)
    a.release()
    store = GcsConditionalStore(_root(gcs, "paused"))
    assert json.loads(store.read(LEASE_FILE).data)["run_id"] == b.me["run_id"] and b.beat() is True


def test_gs_writes_and_deletes_in_place_act_only_on_the_version_read(gcs: str, tmp_path) -> None:
    """What a paused run's export and prune use on gs:// (app/storage/uri_storage.py): an upload or a
    delete conditional on the generation read before its fence check. Once another writer replaced
    the object, neither lands; a create lands only where nothing is. Before: no such calls (an
    unconditional PUT or DELETE through pyarrow)."""
    store, file = GcsConditionalStore(_root(gcs, "inplace")), tmp_path / "model.safetensors"
    file.write_bytes(b"a" * 100)
    assert store.version("model.safetensors") is None
    first = store.put_file("model.safetensors", file, None)
    assert first is not None and store.version("model.safetensors") == first
    assert store.put_file("model.safetensors", file, None) is None  # a create: something is there now
    newer = store.create("x", b"") and store.replace("model.safetensors", b"b", first)  # another writer's
    assert newer is not None and store.put_file("model.safetensors", file, first) is None
    assert store.remove("model.safetensors", first) is False and store.read("model.safetensors").data == b"b"
    assert store.remove("model.safetensors", newer) is True and store.version("model.safetensors") is None
