"""Leases of pulled items, and the generation fences that keep a dead drafter's calls harmless.

A drafter's generation is bumped each time its leases are released (it died or the group is being
rebuilt): a pull sent by an older incarnation, or one still waiting when the release happened, is
refused (LeaseRevoked) and takes nothing. A group generation, bumped on every group reset, also
fences drafters that held no lease.
"""
from __future__ import annotations

from dataclasses import dataclass

from app.pool.buffer import Item


class LeaseRevoked(RuntimeError):
    """A pull that was waiting when its drafter's leases were released (the drafter died or the
    group is being rebuilt). It takes nothing, so no item leaks to a dead drafter."""


@dataclass
class Lease:
    item: Item
    drafter_id: int
    since: float


class LeaseTable:
    """job id -> Lease; per-drafter generations; every drafter id ever seen."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._generation: dict[int, int] = {}
        self.group_generation = 0
        self._seen: set[int] = set()

    # ---- leases ---------------------------------------------------------------------------

    def lease(self, item: Item, drafter_id: int, now: float) -> None:
        jid = item.meta.job_id
        assert jid not in self._leases, f"job {jid} leased twice"
        self._leases[jid] = Lease(item, drafter_id, now)

    def holder(self, job_id: int) -> int | None:
        lease = self._leases.get(job_id)
        return None if lease is None else lease.drafter_id

    def pop(self, job_id: int) -> Lease:
        return self._leases.pop(job_id)

    def of(self, drafter_id: int) -> list[Lease]:
        """The drafter's leases, oldest first."""
        return sorted((ls for ls in self._leases.values() if ls.drafter_id == drafter_id), key=lambda ls: ls.since)

    def count_by_drafter(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for ls in self._leases.values():
            out[ls.drafter_id] = out.get(ls.drafter_id, 0) + 1
        return out

    def __len__(self) -> int:
        return len(self._leases)

    # ---- drafters and fences --------------------------------------------------------------

    def see(self, drafter_id: int) -> None:
        self._seen.add(drafter_id)

    def drafters(self) -> list[int]:
        """Every drafter that ever pulled, holds a lease or was released."""
        return sorted({ls.drafter_id for ls in self._leases.values()} | set(self._generation) | self._seen)

    def generation(self, drafter_id: int) -> int:
        return self._generation.get(drafter_id, 0)

    def bump(self, drafter_id: int) -> None:
        self._generation[drafter_id] = self.generation(drafter_id) + 1

    def bump_group(self) -> None:
        self.group_generation += 1

    def fence(self, drafter_id: int) -> tuple[int, int]:
        """Changes whenever this drafter's waiting pulls must be refused."""
        return self.group_generation, self.generation(drafter_id)
