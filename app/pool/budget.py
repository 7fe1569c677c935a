"""Capacity accounting in items and bytes.

- items: buffered + in_flight < capacity to issue one more. Leased items do not count: they are
  bounded by the drafters' grad_accum and prefetch, and counting them could starve a drafter that
  holds half a step of leases while it waits for the rest (it cannot ack before the step).
- bytes: buffered + leased + in-flight reservations <= capacity_bytes. Leased payloads are still
  pool-owned object-store memory until acked, so they count. An in-flight job reserves
  max(JobSpec.est_bytes, largest payload seen in its bucket); the reservation is replaced by the
  real ItemMeta.nbytes when the job lands. The cap holds as long as estimates are upper bounds; a
  payload larger than its reservation is counted in `overshoot`.
"""
from __future__ import annotations

from app.messages import JobSpec


class Budget:
    def __init__(self, capacity_items: int, capacity_bytes: int, num_buckets: int) -> None:
        self.capacity_items = capacity_items
        self.capacity_bytes = capacity_bytes
        self.buffered = 0  # bytes
        self.leased = 0
        self.reserved = 0
        self.overshoot = 0  # payloads larger than their reservation
        self._max_seen = [0] * num_buckets

    @property
    def total(self) -> int:
        """Object-store bytes held or reserved: buffered + leased + in flight."""
        return self.buffered + self.leased + self.reserved

    def reservation(self, job: JobSpec) -> int:
        # Never above the cap: a bucket that once landed a payload larger than the whole budget
        # would otherwise never fit again, and every pull of the run would answer Drained forever.
        return min(self.capacity_bytes, max(job.est_bytes, self._max_seen[job.bucket]))

    def fits(self, items_held: int, reserve: int) -> bool:
        """Whether one more job (reserving `reserve` bytes) may be issued with `items_held`
        buffered + in flight."""
        return items_held < self.capacity_items and self.total + reserve <= self.capacity_bytes

    def reserve(self, nbytes: int) -> None:
        self.reserved += nbytes

    def unreserve(self, nbytes: int) -> None:
        self.reserved -= nbytes
        assert self.reserved >= 0

    def land(self, reserved: int, nbytes: int, bucket: int) -> None:
        """A job landed: its reservation becomes its real size."""
        self.unreserve(reserved)
        if nbytes > reserved:
            self.overshoot += 1
        self._max_seen[bucket] = max(self._max_seen[bucket], nbytes)
        self.buffered += nbytes

    def unbuffer(self, nbytes: int) -> None:
        """A buffered item dropped unleased (a rollback acked its job)."""
        self.buffered -= nbytes
        assert self.buffered >= 0

    def lease(self, nbytes: int) -> None:
        self.buffered -= nbytes
        self.leased += nbytes
        assert self.buffered >= 0

    def unlease(self, nbytes: int) -> None:
        """An acked, released or lost lease frees its bytes."""
        self.leased -= nbytes
        assert self.leased >= 0
