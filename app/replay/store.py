"""The replay store of one key: its manifest, its byte budget, and each sequence's entry read or written.

Layout under the store's root (`pool.replay`):

    <root>/<key.folder>/manifest.json           the key's fields, written once by the first writer
    <root>/<key.folder>/<aa>/<name>.feat        one sequence's features (entry.py), aa = name[:2]

A manifest that does not name this key (a hash collision, or a hand-edited store) turns replay off for
the run with one line: features are never read from a folder whose key differs. The budget counts every
byte under the root: a writer measures the store when it opens and again each time its own writes since
the last look could have used a quarter of the room then left split over the run's targets, and stops
writing (saying so once) when the next entry would pass `max_bytes`.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from app.replay.entry import BadEntry, decode_entry, encode_entry
from app.replay.key import ReplayKey, sequence_name

MANIFEST = "manifest.json"


@dataclass
class StoreStats:
    """What the store itself saw (the target keeps its own forward / replay counters)."""

    hits: int = 0
    misses: int = 0
    bad: int = 0  # entries that failed their check on a read (removed, so the next forward writes them again)
    written: int = 0
    refused: int = 0  # entries another writer had already written
    skipped_full: int = 0  # entries not written because the budget was spent
    bytes_written: int = 0


@dataclass(frozen=True)
class Stored:
    """One sequence's features as read back: rows [L, D] in the payload dtype, FP8 scales [L] or None."""

    rows: np.ndarray
    scales: np.ndarray | None


class ReplayStore:
    """One key's entries in a replay root (a `backend.LocalFolder` or `UriFolder`), with a byte budget."""

    def __init__(self, backend, key: ReplayKey, max_bytes: int, writers: int = 1, target: str = "",
                 log: Callable[[str], None] = print) -> None:
        self.backend, self.key, self.max_bytes, self.writers = backend, key, int(max_bytes), max(1, writers)
        self.log, self.stats = log, StoreStats()
        self.enabled = self._check_manifest(target)
        self.full_said = self.unreadable_said = False
        backend.clean_stale(key.folder)
        self._measure()

    # ---- reads -------------------------------------------------------------------------------

    def get(self, input_ids: np.ndarray) -> Stored | None:
        """The stored features of the sequence with these token ids, checked; None on a miss or a bad entry."""
        if not self.enabled:
            return None
        name = sequence_name(input_ids)
        data = self._read(self._rel(name))
        if data is None:
            self.stats.misses += 1
            return None
        try:
            rows, scales = decode_entry(data, name, len(input_ids), self.key.payload_dtype)
        except BadEntry as e:
            self.stats.bad += 1
            self.log(f"replay: entry {name} failed its check ({e}); the target computes it again")
            self._remove(self._rel(name))
            return None
        self.stats.hits += 1
        return Stored(rows, scales)

    def _read(self, rel: str) -> bytes | None:
        try:
            return self.backend.read(rel)
        except Exception as e:  # noqa: BLE001 - a store that fails a read is a miss: the target computes the job
            self._say_unreadable(e)
            return None

    def _remove(self, rel: str) -> None:
        try:
            self.backend.remove(rel)
        except Exception as e:  # noqa: BLE001 - left in place, it fails its check again on the next read
            self._say_unreadable(e)

    def _say_unreadable(self, e: Exception) -> None:
        if not self.unreadable_said:
            self.unreadable_said = True
            self.log(f"replay: the store failed a read ({type(e).__name__}: {str(e)[:200]}); such jobs go to the "
                     "target (said once)")

    # ---- writes ------------------------------------------------------------------------------

    def put(self, input_ids: np.ndarray, rows_LD: np.ndarray, scales_L: np.ndarray | None = None,
            job_id: int = -1) -> bool:
        """Keep one sequence's features (its real positions only); False when not written (present, full, off)."""
        if not self.enabled:
            return False
        name = sequence_name(input_ids)
        data = encode_entry(name, rows_LD, self.key.payload_dtype, scales_L, job_id)
        if not self._room_for(len(data)):
            self.stats.skipped_full += 1
            return False
        if not self.backend.create(self._rel(name), data):
            self.stats.refused += 1
            return False
        self.stats.written += 1
        self.stats.bytes_written += len(data)
        self.used += len(data)
        self.since_measure += len(data)
        return True

    def _room_for(self, nbytes: int) -> bool:
        if self.full_said:  # a store only grows: once full, full for good (and no listing per sequence)
            return False
        room_then = max(0, self.max_bytes - self.measured)
        if self.since_measure + nbytes > room_then / (4 * self.writers):  # others may have written meanwhile
            self._measure()
        if self.used + nbytes <= self.max_bytes:
            return True
        if not self.full_said:
            self.full_said = True
            self.log(f"replay: the store holds {self.used / 2**30:.2f} GiB of its {self.max_bytes / 2**30:.2f} GiB "
                     "(pool.replay_max_gb): no more features are written; raise pool.replay_max_gb to keep more")
        return False

    def _measure(self) -> None:
        self.measured = self.used = self.backend.used_bytes()
        self.since_measure = 0

    # ---- the manifest ------------------------------------------------------------------------

    def _check_manifest(self, target: str) -> bool:
        rel = f"{self.key.folder}/{MANIFEST}"
        mine = {"key": self.key.to_dict(), "target": target}
        if self.backend.create(rel, json.dumps(mine, sort_keys=True).encode()):
            return True
        data = self.backend.read(rel)
        try:
            theirs = json.loads(data or b"null")
        except (UnicodeDecodeError, json.JSONDecodeError):
            theirs = None
        if isinstance(theirs, dict) and theirs.get("key") == self.key.to_dict():
            return True
        self.log(f"replay: {rel} does not name this run's key {self.key.to_dict()}: replay is off for this run "
                 "(remove that folder, or point pool.replay elsewhere)")
        return False

    def _rel(self, name: str) -> str:
        return f"{self.key.folder}/{name[:2]}/{name}.feat"
