"""Pins on download cache entries: a process that reads an entry holds it, and nothing evicts or replaces
an entry while any process holds it.

A pin is a shared `flock` on the entry's `pin.lock`, taken before the entry is handed out and kept
until `unpin` or the process ends (the kernel drops the lock of a killed process: a SIGKILLed reader
never pins an entry for good). Whoever removes or replaces an entry (the byte bound, a family's older
versions, a run's end, a start's cleanup of unused entries, a re-download) first `claim`s it: an
exclusive `flock` taken without waiting; an entry someone holds is left where it is. A lock conflicts
with another descriptor of the same process too, so a process's own pins are as safe as others'.
"""
from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PIN_FILE = "pin.lock"
_held: dict[str, int] = {}  # entry path -> the descriptor holding this process's shared lock on it


def _open(folder: Path) -> int | None:
    """The pin file's descriptor, made when missing (an entry of an older layout) without changing the
    folder's mtime: that is its last use, which eviction orders by."""
    try:
        return os.open(folder / PIN_FILE, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        pass
    except OSError:  # a planted link: not an entry to use
        return None
    try:
        before = os.stat(folder, follow_symlinks=False)
        fd = os.open(folder / PIN_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:  # gone meanwhile
        return None
    try:
        os.utime(folder, ns=(before.st_atime_ns, before.st_mtime_ns), follow_symlinks=False)
    except OSError:
        pass
    return fd


def hold(folder: Path) -> int | None:
    """A shared lock on `folder`'s pin file (a download not installed yet: it travels with the rename);
    its descriptor, or None when someone is removing the folder right now."""
    fd = _open(folder)
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def keep(entry: Path, fd: int) -> None:
    """Record `fd` (from `hold`) as this process's pin of `entry`, where the folder now lies."""
    old = _held.pop(str(entry), None)
    _held[str(entry)] = fd
    if old is not None and old != fd:
        os.close(old)


def pin(entry: Path) -> bool:
    """Pin the installed `entry` for this process; False when it is being removed or replaced (the
    caller downloads again). A pin taken is checked to be on the folder now at `entry`."""
    if str(entry) in _held:
        return _same(entry, _held[str(entry)]) or (unpin(entry) and False)
    fd = hold(entry)
    if fd is None:
        return False
    if not _same(entry, fd):
        os.close(fd)
        return False
    _held[str(entry)] = fd
    return True


def unpin(entry: Path) -> bool:
    """Let go of this process's pin of `entry` (a no-op when it holds none). True when it held one."""
    fd = _held.pop(str(entry), None)
    if fd is not None:
        os.close(fd)
    return fd is not None


def _same(entry: Path, fd: int) -> bool:
    try:
        return os.stat(entry / PIN_FILE, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
    except OSError:
        return False


@contextmanager
def claim(entry: Path) -> Iterator[bool]:
    """Around a removal or replacement of `entry`: True while this caller holds it alone (remove it
    then), False when any process pins it (leave it)."""
    fd = _open(entry)
    if fd is None:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)
