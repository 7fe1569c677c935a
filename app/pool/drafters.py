"""Recovery after a drafter or its group fails: re-queueing a payload a drafter lost, releasing a
drafter's leases, resetting the group for a rebuild, and rolling the pool back to a checkpoint's
ledger. Every job the restored weights never saw goes back to the FRONT of the queue (its hidden
states are recomputed, never kept); every job they did see is acked, whatever its state, so it is
never trained twice."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from app.pool.book import JobQueue
from app.pool.holdings import BucketBuffer, Budget
from app.pool.lending import Lending
from app.pool.production import Production
from app.pool.pull_policy import PullPolicy
from app.pool.records import JobCatalog, JobState, JobStates, Ledger
from app.pool.rounds import RoundTracker


class Recovery:
    """Release, group reset and rollback over the pool's shared parts (`HSPool` owns them all);
    calls `changed` after each change and `buffer_changed` when buffered items were acked away."""

    def __init__(self, lending: Lending, rounds: RoundTracker, policy: PullPolicy, eos_drafters: set[int],
                 production: Production, states: JobStates, catalog: JobCatalog, queue: JobQueue,
                 buffer: BucketBuffer, budget: Budget, ledger: Ledger, changed: Callable[[], None],
                 buffer_changed: Callable[[], None]) -> None:
        self._lending, self._rounds, self._policy, self._eos_drafters = lending, rounds, policy, eos_drafters
        self._production, self._states, self._catalog, self._queue = production, states, catalog, queue
        self._buffer, self._budget, self._ledger = buffer, budget, ledger
        self._changed, self._buffer_changed = changed, buffer_changed

    def payload_lost(self, drafter_id: int, job_id: int, generation: int | None) -> bool:
        """One lease whose payload the drafter could not read back to the queue; False if the call is
        outdated or the lease not its own. The drafter pulls again for the same micro-batch."""
        if not self._lending.lost(drafter_id, job_id, generation):
            return False
        self._rounds.untake(drafter_id)
        self._changed()
        return True

    def release(self, drafter_id: int) -> list[int]:
        """Every unacked job of the drafter back to the front of the queue; its waiting pulls fenced."""
        ids = self._lending.release(drafter_id)
        self._rounds.restart(drafter_id)
        self._changed()
        return ids

    def reset_drafters(self) -> list[int]:
        """Release every drafter and forget who got end-of-stream; returns the requeued job ids."""
        leases = self._lending.leases
        ids: list[int] = []
        for d in leases.drafters():
            ids += self.release(d)
        leases.bump_group()
        self._eos_drafters.clear()
        self._rounds.reset()
        self._policy.reset()
        self._changed()
        return ids

    def rollback(self, keep_ids: Iterable[int]) -> int:
        """A drafter group rebuilt from a checkpoint whose ledger is `keep_ids`: every lease and every
        job acked after that checkpoint goes back to the front of the queue (in schedule order),
        since the restored weights never saw them. A lease whose job is in `keep_ids` was trained
        into the checkpoint before its ack reached the pool (acks ride on the next pull): it is acked
        now, not re-queued. So is every other id of `keep`, whatever its state (pending after an earlier
        rollback, in flight, buffered): the restored weights trained it, and issuing it again would
        train it twice. Returns how many were re-queued."""
        keep = set(keep_ids)
        self._lending.ack_kept(keep)
        n = len(self.reset_drafters())
        undo = [j for j in self._ledger.not_in(keep) if j in self._catalog]  # sorted: schedule order
        for job_id in undo:
            self._ledger.discard(job_id)
            self._states.move(job_id, JobState.PENDING)
        self._queue.push_front(undo)  # schedule order at the front
        self._ack_unacked(keep)
        self._changed()
        return n + len(undo)

    def _ack_unacked(self, keep: set[int]) -> None:
        """Ack the ids of a kept ledger that are not acked (quarantined ones stay: never trained)."""
        queued: set[int] = set()
        for job_id in keep:
            state = self._states.get(job_id)
            if state in (None, JobState.ACKED, JobState.QUARANTINED, JobState.LEASED):
                continue  # leases were acked or released just before; unknown ids are not this run's
            if state is JobState.BUFFERED:
                item = self._buffer.remove(job_id, self._catalog.bucket(job_id))
                assert item is not None, f"job {job_id} buffered but not in its bucket"
                self._budget.unbuffer(item.meta.nbytes)
            elif not self._production.take_back(job_id):
                queued.add(job_id)
            self._states.move(job_id, JobState.ACKED)
            self._ledger.add(job_id)
        self._queue.remove(queued)
        self._buffer_changed()
