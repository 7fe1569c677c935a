"""The ledger of acked job ids: saved with each checkpoint, restored on resume.

A small interface on purpose (add, discard, membership, size, ids, the ids outside a kept set), so
the set behind it can become something denser (per-epoch bitmaps) without touching the pool.
"""
from __future__ import annotations

from collections.abc import Iterable


class Ledger:
    def __init__(self) -> None:
        self._ids: set[int] = set()

    def add(self, job_id: int) -> None:
        self._ids.add(job_id)

    def discard(self, job_id: int) -> None:
        self._ids.discard(job_id)

    def __contains__(self, job_id: int) -> bool:
        return job_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def ids(self) -> list[int]:
        """Every acked id, sorted."""
        return sorted(self._ids)

    def not_in(self, keep: Iterable[int]) -> list[int]:
        """Acked ids outside `keep` (a checkpoint's ledger), sorted."""
        return sorted(self._ids - set(keep))
