"""The fencing token of a checkpoint root: writers of a run that lost its lease are refused.

The run lease (app/run/lease.py) guards the driver, not its writers: a driver stopped (SIGSTOP) long
enough loses its lease to a second run while its drafter rank 0 keeps publishing checkpoints into the
same folder. So every new holder of the lease raises a counter, `<root>/.run-fence`, by one (only the
holder writes it, so the counter only grows), and each process that writes entries into the root
holds the token it saw first:

- the driver adopts its lease's token (`adopt`) and hands it to each drafter rank it starts
  (`DrafterSetup.fence_token`, from `extend`); the rank adopts it when it is made (`join`), so a
  rank whose first write comes after another run took the folder (a rank restarted, or one that had
  not written yet, while its driver was stopped) still writes under its own run's token;
- a folder below the leased root that a run writes as its own root (a sweep's `<root>/runs/<name>`) gets
  its own counter, raised to the lease's token by the driver before its ranks start (`extend`): a later
  holder of the root that writes the folder raises it past, and the earlier run's ranks are refused;
- any other process takes the value current at its first write (`note`, `check`);
- before every publish (a checkpoint, the export), again before its commit (the rename, the marker),
  before each delete of a prune or a version sweep, and before each file a process holding a lease token
  writes (`guard`: summary.json, report.html, the uploaded timeline) `check` reads the counter again and
  raises `FencedOut` unless it EQUALS the process's token. It fails closed: a counter that is newer
  (another run holds the folder now), missing or lowered (a dot-file cleanup, `sync --delete`, a lifecycle
  rule deleted it) refuses the write; a live holder's heartbeat writes a missing or lowered counter back
  (app/run/lease.py), so its run only waits a heartbeat, where a stale holder is refused for good.

A check is a read, and the write comes after it: a run that pauses between the two (a GC pause, a
partition) still lands one write after a takeover. So the token also goes WITH what is published (the
commit marker of a URI entry, `ENTRY_TOKEN` in a local one, `Entry.token`): readers, resumers and pruners
rank entries by it (app/training/checkpoint.py: an entry under an older token than one at or below its
step is a stale writer's and is ignored), and a process never deletes an entry written under a newer
token than its own. Until the new holder's first checkpoint no entry of its token exists to rank by, so
each new holder also records the entries it found (`.run-claim`, claim.py): one of an older token that is
not among them landed after the takeover and is ignored the same way.

A root that no lease ever touched has no counter: nothing is fenced (tests, tools that save directly).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from app.storage import claim

FENCE_FILE = ".run-fence"
ENTRY_TOKEN = ".fence-token"  # inside a local entry: the token it was published under (a URI entry's marker says it)
_mine: dict[str, int] = {}  # root -> the token this process writes under


class FencedOut(RuntimeError):
    """This process's run lost the lease on its checkpoint root: it must not write there any more."""


def current(store) -> int:
    """The root's fencing counter (0 when no lease ever set it, or when it is unreadable)."""
    text = (store.read_file(FENCE_FILE) or b"").decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else 0


def _key(root) -> str:
    text = str(root)
    return text.rstrip("/") if "://" in text else os.path.normpath(text)


def adopt(root, token: int) -> None:
    """This process writes `root` under `token` (the driver, once its lease is taken)."""
    _mine[_key(root)] = int(token)


def held(root) -> int:
    """The token this process writes `root` under, or the one of the leased root it lies below (0: none)."""
    key = _holder(root)
    return _mine[key] if key is not None else 0


def _holder(root) -> str | None:
    """The key of `_mine` that gives `root` its token: its own, or the nearest root above it."""
    key = _key(root)
    if key in _mine:
        return key
    path = key.split("?", 1)[0]
    below = [k for k in _mine if path.startswith(k.split("?", 1)[0].rstrip("/") + "/")]
    return max(below, key=len) if below else None


def extend(store) -> int:
    """The token the driver hands the writers of `store.root`: its lease's. A folder below the leased root
    (a sweep run's) gets its own counter raised to that token first (once per process), so a publish
    there is checked against the folder's counter, which a later holder that writes it raises again."""
    token = held(store.root)
    if token and _key(store.root) not in _mine:
        if current(store) < token:
            store.write_file(FENCE_FILE, str(token).encode())
            claim.write(store, token)  # the folder's entries as this holder found them (claim.py)
        adopt(store.root, token)
    return token


def join(root, token: int) -> None:
    """A writer started by the run holding `token` (a drafter rank, from its setup message): it writes
    under that token from its first write on. 0 (a root no lease touched) leaves the first write's rule."""
    if token > 0:
        adopt(root, token)


def note(store) -> None:
    """At a process's first write into the root: the counter then is its token (one read per process)."""
    if _key(store.root) not in _mine:
        _mine[_key(store.root)] = current(store)


def check(store) -> int:
    """`FencedOut` unless the root's counter equals this process's token (the first call of a process
    takes the current counter as its token); the token otherwise. Asked before each publish, commit and
    delete (fails closed: a missing or lowered counter refuses too, see the module docstring)."""
    now = current(store)
    mine = _mine.setdefault(_key(store.root), now)
    if now > mine:
        raise FencedOut(f"another run took the lease on {store.location('')} (fencing token {now}, this run's is "
                        f"{mine}): this run must not write there any more; it stops")
    if now < mine:
        raise FencedOut(f"the fencing counter of {store.location('')} reads {now}, not this run's token {mine} (the "
                        f"{FENCE_FILE} file was deleted or rewritten): this run writes nothing there until its lease "
                        "writes it back; it stops")
    return mine


def guard(store, rel: str) -> None:
    """Before a process writes the single file `rel` into the root: `check` when it writes under a lease's
    token (a stale driver's summary.json, report.html and uploaded timeline are refused), else `note`
    (a root no lease touched: one read per process, as before). The lease's own files are its business."""
    if rel.startswith(".run-"):
        return
    if held(store.root) > 0:
        check(store)
    else:
        note(store)


def lost(root) -> bool:
    """True when this process writes the local folder `root` under a lease's token and the folder's counter
    no longer equals it (another run holds the folder, or the counter is gone): for writers that append in
    place (the local timeline), which drop what they would write instead of raising. One read; False with
    no token."""
    key = _holder(root)
    if key is None or _mine[key] == 0:
        return False
    try:  # the counter of the folder the token was taken for (a sweep run's before its own is raised: the root's)
        return entry_token((Path(key) / FENCE_FILE).read_bytes()) != _mine[key]
    except FileNotFoundError:
        return True


def entry_token(text: bytes | str | None) -> int:
    """A token as written with an entry (digits; anything else, or none: 0, an entry of no lease)."""
    raw = text.decode("ascii", "replace") if isinstance(text, bytes) else (text or "")
    raw = raw.strip()
    return int(raw) if raw.isdigit() and len(raw) <= 18 else 0


@contextmanager
def stop_when_fenced(exit: Callable[[int], None] = os._exit, err=None) -> Iterator[None]:
    """Around a rank's publish: a `FencedOut` is one line on stderr and the process ends (exit 2), as the
    driver does when it finds its lease taken: nothing of this run may write the folder any more."""
    try:
        yield
    except FencedOut as exc:
        print(f"run stopped: {exc}", file=err or sys.stderr, flush=True)
        exit(2)
        raise  # only reached with an `exit` that returns (tests)
