"""Items lent to drafters until they ack them: each ack moves a job into the ledger, a released or
lost lease sends its job back to the FRONT of the queue (the payload is dropped, recomputed later).
Calls from an incarnation older than the drafter's generation (`leases.py`) change nothing."""
from __future__ import annotations

from collections.abc import Iterable

from app.pool.book import JobQueue
from app.pool.holdings import Budget, Item, LeaseTable
from app.pool.records import JobState, JobStates, Ledger
from app.pool.telemetry import PoolTelemetry


class Lending:
    """Leases over the shared job states, byte budget, ledger and queue; counts the acks it ignores."""

    def __init__(self, states: JobStates, budget: Budget, ledger: Ledger, queue: JobQueue,
                 tel: PoolTelemetry) -> None:
        self.leases = LeaseTable()
        self._states, self._budget, self._ledger, self._queue, self._tel = states, budget, ledger, queue, tel

    def lend(self, item: Item, drafter_id: int, now: float) -> None:
        self._budget.lease(item.meta.nbytes)
        self.leases.lease(item, drafter_id, now)
        self._states.move(item.meta.job_id, JobState.LEASED)

    def outdated(self, drafter_id: int, generation: int | None) -> bool:
        """The call comes from an incarnation older than the drafter's current one."""
        return generation is not None and generation < self.leases.generation(drafter_id)

    def ack(self, drafter_id: int, job_ids: list[int], generation: int | None) -> int:
        """Ack the ids leased to this drafter; count the rest (stale, or acked twice)."""
        if self.outdated(drafter_id, generation):
            self._tel.stale_acks += len(job_ids)
            return 0
        n = 0
        for jid in job_ids:
            if jid in self._ledger:
                self._tel.acked_twice += 1
            elif self.leases.holder(jid) != drafter_id:
                self._tel.stale_acks += 1
            else:
                self._ack_one(jid)
                n += 1
        return n

    def _ack_one(self, job_id: int) -> None:
        lease = self.leases.pop(job_id)
        self._budget.unlease(lease.item.meta.nbytes)
        self._ledger.add(job_id)
        self._states.move(job_id, JobState.ACKED)

    def lost(self, drafter_id: int, job_id: int, generation: int | None) -> bool:
        """Re-queue one lease whose payload the drafter could not read; False if not its own."""
        if self.outdated(drafter_id, generation) or self.leases.holder(job_id) != drafter_id:
            return False
        self._requeue([job_id])
        self._tel.lost_payloads += 1
        return True

    def release(self, drafter_id: int) -> list[int]:
        """Every lease of the drafter back to the queue (oldest first at the front); fences it."""
        ids = [ls.item.meta.job_id for ls in self.leases.of(drafter_id)]
        self._requeue(ids)
        self.leases.bump(drafter_id)
        return ids

    def ack_kept(self, keep: set[int]) -> None:
        """Ack the leases whose jobs a checkpoint already holds (trained before their ack arrived)."""
        for d in self.leases.drafters():
            for lease in self.leases.of(d):
                if lease.item.meta.job_id in keep:
                    self._ack_one(lease.item.meta.job_id)

    def _requeue(self, job_ids: Iterable[int]) -> None:
        """Leases back to the front of the queue, in the given order; payloads are dropped."""
        job_ids = list(job_ids)
        for jid in job_ids:
            lease = self.leases.pop(jid)
            self._budget.unlease(lease.item.meta.nbytes)
            self._states.move(jid, JobState.PENDING)
        self._queue.push_front(job_ids)
