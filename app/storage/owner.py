"""Whose a pid is: this boot and pid namespace, and whether a process of it still runs.

A pid means one process only within one pid namespace of one boot. Two containers or pods with one
fixed hostname each see only their own pids (each has its pid 1), and a host that rebooted hands the
old numbers out again. So whatever records a pid to be judged later (the run lease's record,
app/run/lease_record.py; the names of staging folders and partial downloads, local_cache.py
`owned_tmp`) records these with it, and a pid is judged only where they match this process's.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

UNKNOWN = "x"  # the namespace tag where /proc does not say (then no pid of it is judged)


def namespace() -> dict:
    """What makes a pid mean the same process here and in a record: this boot (`boot_id`) and this pid
    namespace (`pid:[<inode>]`). Empty parts where /proc does not say (then no pid is judged)."""
    found = {}
    for key, read in (("boot", lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip()),
                      ("pidns", lambda: os.readlink("/proc/self/ns/pid"))):
        try:
            found[key] = read()
        except OSError:
            pass
    return found


def namespace_tag() -> str:
    """`namespace()` in 12 hex digits, for a name (`UNKNOWN` when /proc does not say both parts)."""
    here = namespace()
    if len(here) != 2:
        return UNKNOWN
    return hashlib.sha256(f"{here['boot']}\0{here['pidns']}".encode()).hexdigest()[:12]


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs in this pid namespace (another user's live process counts: it is not
    ours to judge)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
