"""Issue 49, items 3 and 4: the lease's release and heartbeat never write over a lease another run took in
between, and a lease is not taken over on a pid that this pid namespace cannot see. Local folders and
the moto S3 of tests/s3_server.py; a faked clock; no Ray.

A "pause" runs run B's takeover at a chosen call of the stale holder's release or heartbeat. Checked
against the code before this change (2f4199a): each test failed there (release and beat checked `held()`
and then deleted or wrote unconditionally; a same-hostname lease whose pid was not visible was taken).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from app.run import lease as lease_module
from app.run.lease import LEASE_FILE, LeaseHeld, RunLease
from app.storage import fence


def namespace() -> dict:
    """This process's boot and pid namespace, read here as the lease records them (app/run/lease_record.py)."""
    found = {}
    for key, read in (("boot", lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip()),
                      ("pidns", lambda: os.readlink("/proc/self/ns/pid"))):
        try:
            found[key] = read()
        except OSError:
            pass
    return found


class Once:
    """Calls `meanwhile` the first time the wrapped function is called while armed (then the real one)."""

    def __init__(self, real, meanwhile, after: bool = False) -> None:
        self.real, self.meanwhile, self.after, self.armed, self.fired = real, meanwhile, after, False, False

    def __call__(self, *args, **kwargs):
        fire = self.armed and not self.fired
        if fire and not self.after:
            self.fired = True
            self.meanwhile()
        out = self.real(*args, **kwargs)
        if fire and self.after:
            self.fired = True
            self.meanwhile()
        return out


def _takeover(root: str, now: list[float], taken: list) -> None:
    now[0] += 61  # the holder was paused past its timeout
    fence_tables = fence._mine
    try:
        fence._mine = {}
        taken.append(RunLease(root, 60, clock=lambda: now[0]).acquire())
    finally:
        fence._mine = fence_tables


class Proxy:
    """The stale holder's conditional store: any call first runs `hook` (armed once)."""

    def __init__(self, real, hook: Once) -> None:
        self.real, self.hook = real, hook

    def __getattr__(self, name):
        method = getattr(self.real, name)

        def call(*args, **kwargs):
            self.hook.real = lambda: None
            self.hook()
            return method(*args, **kwargs)

        return call


def test_a_paused_s3_release_leaves_the_new_holder_s_lease(s3, atomic_puts, monkeypatch) -> None:  # noqa: F811
    """A's release is paused before it touches the lease object; B takes the stale lease over meanwhile.
    A's release then changes nothing (its write is conditional on its own version), so C is refused.
    Before: release checked `held()`, then deleted B's lease unconditionally and C took it."""
    monkeypatch.setattr(fence, "_mine", {})
    root, now, taken = s3.uri(f"release-{uuid.uuid4().hex[:6]}"), [1000.0], []
    a = RunLease(root, 60, clock=lambda: now[0]).acquire()
    hook = Once(None, lambda: _takeover(root, now, taken))
    a._conditional = Proxy(a._conditional, hook)
    hook.armed = True
    a.release()
    assert hook.fired and taken[0].held() and not a.held()
    with pytest.raises(LeaseHeld, match="another run holds"):
        RunLease(root, 60, clock=lambda: now[0]).acquire()
    taken[0].release()
    again = RunLease(root, 60, clock=lambda: now[0]).acquire()  # a released lease is free at once
    assert again.taken_over is None and again.token == 3
    again.release()


@pytest.mark.parametrize("where", ["before_move", "after_read"])
def test_a_paused_local_release_leaves_the_new_holder_s_lease(where: str, tmp_path: Path, monkeypatch) -> None:
    """The same on a local folder: B takes over while A's release is paused before it moves the lease file
    (it moves B's, sees it is not its own and puts it back) or after it read it. Before: release read
    the file, then unlinked whatever was there."""
    monkeypatch.setattr(fence, "_mine", {})
    root, now, taken = str(tmp_path / "run"), [1000.0], []
    a = RunLease(root, 60, clock=lambda: now[0]).acquire()
    if where == "before_move":
        real = os.rename
        hook = Once(real, lambda: _takeover(root, now, taken))
        monkeypatch.setattr(os, "rename", lambda src, dst: (hook if Path(dst).name.startswith(f"{LEASE_FILE}.release")
                                                             else real)(src, dst))
    else:
        hook = Once(lease_module.read_json, lambda: _takeover(root, now, taken), after=True)
        monkeypatch.setattr(lease_module, "read_json", hook)
    hook.armed = True
    a.release()
    assert hook.fired and taken[0].held() and not a.held()
    with pytest.raises(LeaseHeld, match="another run holds"):
        RunLease(root, 60, clock=lambda: now[0]).acquire()


def test_a_paused_local_heartbeat_never_overwrites_the_new_holder_s_lease(tmp_path: Path, monkeypatch) -> None:
    """A's heartbeat read its lease (its own) and pauses; B takes it over. A's write lands in the file it
    read, which B moved aside: B's lease is untouched, and A's next heartbeat says it is lost. Before:
    the heartbeat replaced the file at the path, B's lease with A's, and B stopped instead of A."""
    monkeypatch.setattr(fence, "_mine", {})
    root, now, taken = str(tmp_path / "run"), [1000.0], []
    a = RunLease(root, 60, clock=lambda: now[0]).acquire()
    hook = Once(lease_module.read_json, lambda: _takeover(root, now, taken), after=True)
    monkeypatch.setattr(lease_module, "read_json", hook)
    hook.armed = True
    a.beat()
    assert hook.fired and taken[0].held() and taken[0].beat()
    assert json.loads((Path(root) / LEASE_FILE).read_bytes())["run_id"] == taken[0].me["run_id"]
    assert a.beat() is False


def _record(**fields) -> dict:
    return {"host": socket.gethostname(), "run_id": "other", "heartbeat": time.time(), "token": 1, **fields}


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


@pytest.mark.parametrize("identity", ["none recorded", "another pid namespace", "another boot"])
def test_a_fresh_lease_whose_pid_is_not_visible_here_is_refused(identity: str, tmp_path: Path) -> None:
    """Two containers with one hostname: the holder's pid is not visible in this pid namespace, which
    says nothing about it. Refused unless the record names this boot and pid namespace. Before: taken
    over at once, and the second start killed a live run."""
    here = namespace()
    fields = {"none recorded": {}, "another pid namespace": {**here, "pidns": "pid:[1]"},
              "another boot": {**here, "boot": str(uuid.uuid4())}}[identity]
    (tmp_path / LEASE_FILE).write_text(json.dumps(_record(pid=_dead_pid(), **fields)))
    with pytest.raises(LeaseHeld, match="another run holds"):
        RunLease(tmp_path, 3600).acquire()


def test_a_fresh_lease_of_a_dead_pid_in_this_namespace_is_taken_at_once(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(fence, "_mine", {})
    assert len(namespace()) == 2  # Linux: boot_id and the pid namespace are readable
    (tmp_path / LEASE_FILE).write_text(json.dumps(_record(pid=_dead_pid(), **namespace())))
    lease = RunLease(tmp_path, 3600).acquire()
    assert lease.taken_over["run_id"] == "other" and lease.held() and lease.token == 2
    lease.release()
