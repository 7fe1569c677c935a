"""A run lease record: who wrote it (host, pid, Ray job, this boot and pid namespace), when it is stale, and
reading it off a local file while a taker may still be writing it (the boot and pid namespace are read
as app/storage/owner.py reads them for every recorded pid). The lease itself (taking, keeping and
releasing it, the fencing token) is app/run/lease.py.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from app.storage.owner import namespace, pid_alive  # this boot and pid namespace: where a pid means a process


def submission_id() -> str:
    """The `ray job submit` id of this driver ("" outside a submitted job): Ray passes it in the job config."""
    try:
        config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    except ValueError:
        return ""
    return str((config.get("metadata") or {}).get("job_submission_id", "")) if isinstance(config, dict) else ""


def is_stale(holder: dict, timeout_s: float, now: float) -> bool:
    """A lease nobody keeps: released, no heartbeat for `timeout_s`, or its process gone from this host;
    a pid counts only when the record names this hostname, boot and pid namespace (a pid that another
    container's namespace hides is not a dead one)."""
    if holder.get("released") or now - float(holder.get("heartbeat", 0.0)) > timeout_s:
        return True
    here = namespace()
    same = holder.get("host") == socket.gethostname() and len(here) == 2 \
        and all(holder.get(k) == v for k, v in here.items())
    return same and not pid_alive(int(holder.get("pid", 0)))


def describe(holder: dict) -> str:
    age = time.time() - float(holder.get("heartbeat", 0.0))
    job = f", job {holder['job']}" if holder.get("job") else ""
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}, heartbeat {age:.0f} s ago"


def read_local(path: Path, settle_s: float = 2.0) -> dict | None:
    """The lease file's holder; None when there is none. An empty file is a lease being written
    (created, content not yet in): read again for `settle_s`, then judge it by its age."""
    deadline = time.monotonic() + settle_s
    while True:
        try:
            data, mtime = path.read_bytes(), path.stat().st_mtime
        except FileNotFoundError:
            return None
        if data or time.monotonic() > deadline:
            return read_json(data) if data else {"heartbeat": mtime}
        time.sleep(0.1)


def read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def read_json(data: bytes | None) -> dict | None:
    if not data:
        return None
    try:
        out = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return {}  # unreadable: treated as a lease with no heartbeat, i.e. stale
    return out if isinstance(out, dict) else {}
