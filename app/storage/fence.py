"""The fencing token of a checkpoint root: writers of a run that lost its lease are refused.

The run lease (app/run/lease.py) guards the driver, not its writers: a driver stopped (SIGSTOP) long
enough loses its lease to a second run while its drafter rank 0 keeps publishing checkpoints into the
same folder. So every new holder of the lease raises a counter, `<root>/.run-fence`, by one (only the
holder writes it, so the counter only grows), and each process that writes entries into the root
holds the token it saw first:

- the driver adopts its lease's token (`adopt`);
- any other process (a drafter rank) takes the value current at its first write (`note`, `check`): its
  run's driver started it, so that is its run's token (rank 0 writes its probe at each group start);
- before every publish (a checkpoint, the export) `check` reads the counter again and raises
  `FencedOut` when it is newer than the process's token: another run holds the folder now.

A root that no lease ever touched has no counter: nothing is fenced (tests, tools that save directly).
"""
from __future__ import annotations

import os

FENCE_FILE = ".run-fence"
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


def note(store) -> None:
    """At a process's first write into the root: the counter then is its token (one read per process)."""
    if _key(store.root) not in _mine:
        _mine[_key(store.root)] = current(store)


def check(store) -> None:
    """`FencedOut` when the root's counter is newer than this process's token (the first call of a
    process takes the current counter as its token). Asked before each publish."""
    now = current(store)
    mine = _mine.setdefault(_key(store.root), now)
    if now > mine:
        raise FencedOut(f"another run took the lease on {store.location('')} (fencing token {now}, this run's is "
                        f"{mine}): this run must not write there any more; it stops")
