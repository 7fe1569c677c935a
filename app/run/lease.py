# Over 300 lines: one lease held three ways (O_EXCL file, conditional PUT, read-back) under one stale and token rule.
"""The run lease: one run at a time on a `checkpoint.dir`, and the fencing token of each holder.

Two drivers on one folder destroy each other (orphan cleanup, pruning and version sweeps delete the
other's work). The driver takes the lease before it touches the folder and holds it to the end:

- local folder (and `file://`): `<dir>/.run-lease`, created with `O_CREAT|O_EXCL` (exactly one creator
  wins), holding host, pid, Ray job id, a random run id and a heartbeat the driver refreshes every
  quarter of `checkpoint.lease_timeout_s`. A lease whose heartbeat is older than that, or whose holder
  is a dead process on this host, is stale: it is moved aside under a unique name (one taker wins the
  rename) and taken over. "This host" is the same hostname AND the same boot (`boot_id`) and pid
  namespace (`/proc/self/ns/pid`), both recorded in the lease: two containers or pods with one fixed
  hostname each see only their own pids, so a pid not visible there means nothing and such a lease goes
  stale only by its heartbeat. The heartbeat is written into the lease file in place, through a file
  descriptor whose content was checked to be this holder's (a taker that moved it aside meanwhile gets
  nothing written over its own lease), and the release moves the file aside and deletes it only if what
  it moved is this holder's (else it puts it back), as the take does.
- `s3://`: the same object, created only if absent (`If-None-Match: *`) and replaced only if unchanged
  (`If-Match: <etag>`, a stale lease taken over, each heartbeat), so of any number of drivers starting
  at once exactly one wins, and a holder whose lease was taken over learns it at its next heartbeat
  (app/storage/conditional.py, boto3); the release replaces it, again only if unchanged, with a record
  marked released (its token kept), which the next run takes at once. `gs://`: the same with GCS's
  generation preconditions
  (`ifGenerationMatch`, google-auth and requests). Other URIs (or either without its client): `pyarrow.fs` has no
  conditional PUT, so the lease object is read, written, and read back: two runs starting within the
  same second can both win there. Start one run per such URI.

A heartbeat is the holder's wall clock; another host's may run behind the taker's, so a lease from
another host is taken only if it also stays unchanged for a heartbeat period on the taker's own clock.

Each new holder takes a fencing token one above the largest it finds (the folder's counter, the token in
the lease record it replaces, the tokens its published entries carry), writes it to the counter and to
its lease record, and writes under it (app/storage/fence.py): a checkpoint or export published by a run
whose driver lost the lease (stopped with SIGSTOP while its drafters ran on) is refused (`FencedOut`).
It also records the entries it found (`.run-claim`, app/storage/claim.py): one of an older token that
lands after the takeover is never its resume point, nor its drafter group's rebuild point.
The counter fails closed (a missing one refuses every writer); a live holder's heartbeat writes it back.

A refused start is one line, exit 2 (`LeaseHeld`). A holder that finds its lease taken over (its
heartbeats were missed for longer than the timeout) calls `on_lost`: the driver stops at once.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from app.config.errors import ConfigError, UserError
from app.run.lease_record import describe, is_stale, namespace, read_bytes, read_json, read_local, submission_id
from app.storage import claim, fence
from app.storage.conditional import conditional_store
from app.storage.local_cache import forget_downloads
from app.storage.roots import is_uri, open_storage, redact, root_problem

LEASE_FILE = ".run-lease"
RECORD_BYTES = 1024  # a lease record's length on disk at least (JSON, space-padded)
WATCH_MARGIN_S = 5.0  # past one heartbeat period, how long a lease from another host is watched before it is taken


class LeaseHeld(UserError):
    """Another run holds the lease on this `checkpoint.dir`."""

    kind = "checkpoint"


class RunLease:
    """The exclusive lease of one run on its `checkpoint.dir` (see the module docstring)."""

    def __init__(self, root: str | Path, timeout_s: float, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.root, self.timeout_s, self.clock, self.sleep = str(root), float(timeout_s), clock, sleep
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "job": submission_id(), "run_id": uuid.uuid4().hex,
                   **namespace()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.taken_over: dict | None = None  # the stale holder this lease replaced, if any
        self._replaced: dict | None = None  # the record this lease replaced (stale or released): its token counts
        self.token = 0  # this holder's fencing token (fence.py), set once the lease is taken
        self._conditional = conditional_store(self.root)  # s3:// with boto3: exact create / replace
        self._etag = ""  # the version of the lease object this holder wrote last (conditional stores)

    # ---- acquire / release ---------------------------------------------------------------------

    def acquire(self) -> "RunLease":
        """Take the lease or raise `LeaseHeld` with who holds it; `ConfigError` (one line) for a root that
        cannot hold a run (`root_problem`: unknown scheme, store unreachable, no such bucket)."""
        if (problem := root_problem(self.root)) is not None:
            raise ConfigError(f"checkpoint.dir={redact(self.root)}: {redact(problem)}; fix checkpoint.dir (a local path, "
                              "or s3://bucket/prefix?endpoint_override=host:port&scheme=http for an S3 store)")
        if self._conditional is not None:
            self._acquire_conditional()
        elif is_uri(self.root) and urlsplit(self.root).scheme != "file":
            warnings.warn(f"checkpoint.dir={redact(self.root)}: no conditional write here (for s3://: pip install "
                          "'dflash-ray[s3]'; for gs://: pip install google-auth requests), so two runs starting at the "
                          "same moment could both take the lease; start one run per folder")
            self._acquire_uri()
        else:
            self._acquire_local()
        self.token = self._next_token()
        open_storage(self.root).write_file(fence.FENCE_FILE, str(self.token).encode())
        claim.write(open_storage(self.root), self.token)  # what it found: a stale commit landing later is not in it
        fence.adopt(self.root, self.token)
        self.beat()  # the token into the lease record too: a counter deleted later cannot hand it out again
        return self

    def _next_token(self) -> int:
        """One above the largest token this folder shows: its counter, the record replaced, its entries'."""
        store = open_storage(self.root)
        replaced = fence.entry_token(str((self._replaced or self.taken_over or {}).get("token", "")))
        published = max((e.token for e in store.entries("")), default=0)
        return max(fence.current(store), replaced, published) + 1

    def _local_dir(self) -> Path:
        return Path(urlsplit(self.root).path) if is_uri(self.root) else Path(self.root)

    def _record(self, **extra) -> bytes:
        """This holder's lease record, padded to RECORD_BYTES: a heartbeat written in place over the
        previous one is as long, so a reader never sees the tail of an older record."""
        data = json.dumps({**self.me, "token": self.token, "heartbeat": self.clock(), **extra}).encode()
        return data.ljust(RECORD_BYTES)

    def _refuse(self, holder: dict) -> None:
        raise LeaseHeld(f"another run holds checkpoint.dir={redact(self.root)} ({describe(holder)}); wait for it "
                        f"to end, or use another checkpoint.dir (a crashed run's lease goes stale after "
                        f"checkpoint.lease_timeout_s={self.timeout_s:g})")

    def _acquire_local(self) -> None:
        path = self._local_dir() / LEASE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a stale lease moved aside, then created again; a racing taker may win a round
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)  # exactly one creator wins
            except FileExistsError:
                holder = read_local(path)
                if holder is None:
                    continue  # released between our create and our read
                self._check_stale(holder, lambda: read_bytes(path))
                self._move_aside(path, holder)
                continue
            with os.fdopen(fd, "wb") as out:
                out.write(self._record())
            return
        raise LeaseHeld(f"could not take the lease on checkpoint.dir={redact(self.root)}: other runs are starting "
                        "on it at the same time; start one")

    def _check_stale(self, holder: dict, read: Callable[[], bytes | None]) -> None:
        """Refuse unless `holder`'s lease is stale. Its heartbeat is the holder's wall clock: another
        host's may run behind ours, so a lease from another host that only looks stale is watched for
        one heartbeat period (and a margin) on our own clock: a live holder rewrites it, and keeps it."""
        if not is_stale(holder, self.timeout_s, self.clock()):
            self._refuse(holder)
        if holder.get("released") or holder.get("host") in (None, socket.gethostname()):
            return  # written by this host's clock, or a dead process here
        before = read()
        self.sleep(self.timeout_s / 4 + WATCH_MARGIN_S)
        after = read()
        if after is not None and after != before:
            self._refuse(read_json(after) or holder)

    def _move_aside(self, path: Path, holder: dict) -> None:
        """Rename the stale lease to a unique name (of several takers one wins the rename); if what was
        moved is not the stale lease read a moment ago, a new holder got in first: put it back, refuse."""
        aside = path.with_name(f"{LEASE_FILE}.stale-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return
        moved = read_json(aside.read_bytes()) or {}
        if moved.get("run_id") != holder.get("run_id"):
            try:
                os.link(aside, path)  # back in place unless yet another run got in meanwhile
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)
            self._refuse(moved)
        aside.unlink(missing_ok=True)
        self.taken_over = holder

    def _acquire_conditional(self) -> None:
        """Create the lease object if absent; a stale one is replaced only if still the version read."""
        store = self._conditional
        for _ in range(3):  # a lease released between our create and our read: try again
            if (etag := store.create(LEASE_FILE, self._record())) is not None:
                self._etag = etag
                return
            found = store.read(LEASE_FILE)
            if found is None:
                continue
            holder = read_json(found.data) or {}
            self._check_stale(holder, lambda: getattr(store.read(LEASE_FILE), "data", None))
            if (etag := store.replace(LEASE_FILE, self._record(), found.etag)) is not None:
                self._etag, self._replaced = etag, holder
                self.taken_over = None if holder.get("released") else holder  # a released lease: just free
                return
        raise LeaseHeld(f"could not take the lease on checkpoint.dir={redact(self.root)}: other runs are starting "
                        "on it at the same time; start one")

    def _acquire_uri(self) -> None:
        store = open_storage(self.root)
        if store.fs.type_name == "local":  # file:// needs the folder; on an object store a create_dir could make a bucket
            store.fs.create_dir(store.base, recursive=True)
        holder = read_json(store.read_file(LEASE_FILE))
        if holder is not None:
            self._check_stale(holder, lambda: store.read_file(LEASE_FILE))
        self.taken_over = holder
        store.write_file(LEASE_FILE, self._record())
        time.sleep(1.0)  # last writer wins: a run that wrote just after us is read back here
        now = read_json(store.read_file(LEASE_FILE))
        if now is None or now.get("run_id") != self.me["run_id"]:
            self._refuse(now or {})

    def release(self) -> None:
        """Stop the heartbeat, drop the lease if it is still ours, and (URI roots) this run's downloads
        on this node (app/storage/local_cache.py `forget_downloads`). Never a check, then a write: on
        S3/GCS the lease is replaced by a released record only if it is still the version this holder
        wrote; on a local folder it is moved aside and deleted only if what was moved is ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._conditional is not None:
            if self._etag:
                self._conditional.replace(LEASE_FILE, self._record(released=True), self._etag)
        elif self._local():
            self._release_local()
        elif self.held():  # no conditional write here: a check, then the delete
            open_storage(self.root).remove_file(LEASE_FILE)
        if is_uri(self.root):  # the run ends here: its downloaded checkpoint versions and exports leave this node's disk
            forget_downloads(self.root)

    def _local(self) -> bool:
        return not is_uri(self.root) or urlsplit(self.root).scheme == "file"

    def _release_local(self) -> None:
        path = self._local_dir() / LEASE_FILE
        aside = path.with_name(f"{LEASE_FILE}.release-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return
        moved = read_json(read_bytes(aside)) or {}
        if moved.get("run_id") != self.me["run_id"]:  # another run's lease: back in place unless a third took it
            try:
                os.link(aside, path)
            except FileExistsError:
                pass
        aside.unlink(missing_ok=True)

    # ---- heartbeat -----------------------------------------------------------------------------

    def held(self) -> bool:
        """True while the lease on the folder is still this run's."""
        holder = read_json(open_storage(self.root).read_file(LEASE_FILE))
        return holder is not None and holder.get("run_id") == self.me["run_id"] and not holder.get("released")

    def beat(self) -> bool:
        """Refresh the heartbeat; False (and nothing written) when another run has taken the lease over.
        A live holder's missing or lowered fencing counter is written back (fence.py fails closed)."""
        if self._conditional is not None:  # replaced only if still ours: a taker's version is never overwritten
            etag = self._conditional.replace(LEASE_FILE, self._record(), self._etag)
            self._etag = etag or self._etag
            ok = etag is not None
        elif self._local():
            ok = self._beat_local()
        else:
            ok = self.held()
            if ok:
                open_storage(self.root).write_file(LEASE_FILE, self._record())
        if ok and self.token:
            self._restore_counter()
        return ok

    def _beat_local(self) -> bool:
        """The heartbeat written into the very file this holder read as its own (one descriptor): a taker
        that moved it aside meanwhile gets nothing written over the lease it created."""
        try:
            fd = os.open(self._local_dir() / LEASE_FILE, os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            holder = read_json(os.pread(fd, 1 << 16, 0)) or {}
            if holder.get("run_id") != self.me["run_id"] or holder.get("released"):
                return False
            record = self._record()
            os.pwrite(fd, record, 0)
            os.ftruncate(fd, len(record))  # a record past RECORD_BYTES (a long job id) leaves no tail behind
            return True
        finally:
            os.close(fd)

    def _restore_counter(self) -> None:
        store = open_storage(self.root)
        if fence.current(store) < self.token:  # deleted (a dot-file cleanup) or lowered: ours again
            store.write_file(fence.FENCE_FILE, str(self.token).encode())

    def keep_alive(self, on_lost: Callable[[str], None]) -> None:
        """Refresh the heartbeat every quarter of the timeout in a daemon thread; `on_lost(line)` once
        the lease is found taken over (or cannot be refreshed for a whole timeout)."""
        def loop() -> None:
            last_ok = self.clock()
            while not self._stop.wait(self.timeout_s / 4):
                try:
                    if not self.beat():
                        return on_lost(f"the lease on checkpoint.dir={redact(self.root)} was taken over by another "
                                       "run (heartbeats missed); stopping so that the two runs do not mix")
                    last_ok = self.clock()
                except OSError as exc:  # a storage hiccup: retried at the next beat, up to the timeout
                    if self.clock() - last_ok > self.timeout_s:
                        return on_lost(f"the lease on checkpoint.dir={redact(self.root)} could not be refreshed "
                                       f"for {self.timeout_s:g} s ({type(exc).__name__}); stopping")

        self._thread = threading.Thread(target=loop, name="run-lease", daemon=True)
        self._thread.start()
