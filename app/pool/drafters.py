"""The drafters' side of the pool: what a pull gets, the leases until the acks, and recovery when a
drafter or its group fails.

A pull gets end-of-stream once every job is acked; nothing (wait) while the reservoir holds fewer
than `min_ready` items; a drained step when nothing more will come for it; else one buffered item,
from the bucket the pull policy picks for this drafter's round of the global step, leased to the
drafter. Each ack moves a job into the ledger; a released or lost lease sends its job back to the
FRONT of the queue (the payload is dropped, recomputed later). Calls from an incarnation older than
the drafter's generation (the fences: `holdings.py`) change nothing.

Recovery: re-queueing a payload a drafter lost, releasing a drafter's leases, resetting the group for
a rebuild, and rolling the pool back to a checkpoint's ledger. Every job the restored weights never
saw goes back to the FRONT of the queue (its hidden states are recomputed, never kept); every job
they did see is acked, whatever its state, so it is never trained twice.

Rounds: which global step each pull belongs to, inferred from the drafters' pull pattern. A drafter
pulls exactly grad_accum items per optimizer step, one outstanding pull at a time, unless a pull
returns `Drained`, after which it steps with what it holds. So the pool can number each drafter's
steps by counting: after `accum` items, or a Drained, its next pull opens the next round. The ranks
run in lockstep, so round r of every rank is the same global step. A payload lost in transit is
pulled again for the same slot; a rebuilt group starts every rank at a fresh round.
"""
from __future__ import annotations

import random
from collections.abc import Iterable

from app.messages import Drained, EndOfStream, PulledItem
from app.pool.book import JobBook
from app.pool.holdings import Item
from app.pool.sides import Production
from app.pool.pull_policy import PullContext, PullPolicy
from app.pool.records import JobState


class Drafters:
    """Pulls, acks, releases and rollbacks over the pool's book; owns the rounds, the pull policy's
    random stream and who got end-of-stream. Asks `production` whether every job is produced (and
    whether it stalled), and hands it back in-flight jobs a rollback acks."""

    def __init__(self, book: JobBook, production: Production, policy: PullPolicy, rounds: RoundTracker,
                 min_ready: int, seed: int) -> None:
        self.rounds = rounds
        self.eos: set[int] = set()  # drafters that got end-of-stream
        self.leases = book.leases  # generations and fences
        self._book, self._production, self._policy = book, production, policy
        self._min_ready, self._rng = min_ready, random.Random(seed)
        self._buffer, self._states, self._ledger, self._tel = book.buffer, book.states, book.ledger, book.tel

    @property
    def done(self) -> bool:
        """Every job is acked."""
        return self._production.finished and not self._buffer and not self.leases

    # ---- pulls ----------------------------------------------------------------------------

    def try_pull(self, drafter_id: int) -> PulledItem | EndOfStream | Drained | None:
        """Lease one item to the drafter; None means wait (the reservoir is not ready)."""
        if self.done:
            self.eos.add(drafter_id)
            return EndOfStream()
        buffered = len(self._buffer)
        finished = self._production.finished
        draining = finished or self._production.stalled()
        if buffered == 0:
            # Also drain when leases hold the byte budget and nothing is in flight: the rank must
            # step with what it has and ack, or its own leases would block the next job forever.
            return self._drained(drafter_id) if draining else None
        if buffered < self._min_ready and not draining:
            return None
        rnd = self.rounds.round(drafter_id)
        ctx = PullContext(drafter_id, rnd, self._buffer.counts(), self.rounds.step_items, finished,
                          self.rounds.open_slots(), self.rounds.ranks is not None, self._buffer.mean_costs(),
                          self.rounds.slots_in(rnd))
        bucket = self._policy.choose(ctx, self._rng)
        if bucket is None:  # the policy ends this step early (equal steps over the last items)
            return self._drained(drafter_id)
        item = self._buffer.take(bucket, self._rng,
                                 self._policy.pick(ctx, bucket, self._buffer.costs(bucket), self._rng))
        self._policy.served(ctx, bucket, item.job.cost)
        self._lend(item, drafter_id)
        self.rounds.took(drafter_id)
        self._tel.served[bucket] += 1
        self._production.buffer_changed()
        self._book.changed()  # a freed item slot may let a job be issued
        return PulledItem(meta=item.meta, payload_ref=item.payload)

    def _drained(self, drafter_id: int) -> Drained:
        self.rounds.step_ended(drafter_id)
        return Drained()

    def _lend(self, item: Item, drafter_id: int) -> None:
        self._book.budget.lease(item.meta.nbytes)
        self.leases.lease(item, drafter_id, self._book.clock())
        self._states.move(item.meta.job_id, JobState.LEASED)

    # ---- acks and lost leases -------------------------------------------------------------

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
        self._book.budget.unlease(lease.item.meta.nbytes)
        self._ledger.add(job_id)
        self._states.move(job_id, JobState.ACKED)

    def payload_lost(self, drafter_id: int, job_id: int, generation: int | None) -> bool:
        """One lease whose payload the drafter could not read back to the queue; False if the call is
        outdated or the lease not its own. The drafter pulls again for the same micro-batch."""
        if self.outdated(drafter_id, generation) or self.leases.holder(job_id) != drafter_id:
            return False
        self._requeue([job_id])
        self._tel.lost_payloads += 1
        self.rounds.untake(drafter_id)
        self._book.changed()
        return True

    def _requeue(self, job_ids: Iterable[int]) -> None:
        """Leases back to the front of the queue, in the given order; payloads are dropped."""
        job_ids = list(job_ids)
        for jid in job_ids:
            lease = self.leases.pop(jid)
            self._book.budget.unlease(lease.item.meta.nbytes)
            self._states.move(jid, JobState.PENDING)
        self._book.queue.push_front(job_ids)

    # ---- recovery -------------------------------------------------------------------------

    def release(self, drafter_id: int) -> list[int]:
        """Every unacked job of the drafter back to the front of the queue (oldest first); its waiting
        pulls fenced."""
        ids = [ls.item.meta.job_id for ls in self.leases.of(drafter_id)]
        self._requeue(ids)
        self.leases.bump(drafter_id)
        self.rounds.restart(drafter_id)
        self._book.changed()
        return ids

    def reset(self) -> list[int]:
        """Release every drafter and forget who got end-of-stream; returns the requeued job ids."""
        ids: list[int] = []
        for d in self.leases.drafters():
            ids += self.release(d)
        self.leases.bump_group()
        self.eos.clear()
        self.rounds.reset()
        self._policy.reset()
        self._book.changed()
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
        self._ack_kept(keep)
        n = len(self.reset())
        undo = [j for j in self._ledger.not_in(keep) if j in self._book.catalog]  # sorted: schedule order
        for job_id in undo:
            self._ledger.discard(job_id)
            self._states.move(job_id, JobState.PENDING)
        self._book.queue.push_front(undo)  # schedule order at the front
        self._ack_unacked(keep)
        self._book.changed()
        return n + len(undo)

    def _ack_unacked(self, keep: set[int]) -> None:
        """Ack the ids of a kept ledger that are not acked (quarantined ones stay: never trained)."""
        queued: set[int] = set()
        for job_id in keep:
            state = self._states.get(job_id)
            if state in (None, JobState.ACKED, JobState.QUARANTINED, JobState.LEASED):
                continue  # leases were acked or released just before; unknown ids are not this run's
            if state is JobState.BUFFERED:
                item = self._buffer.remove(job_id, self._book.catalog.bucket(job_id))
                assert item is not None, f"job {job_id} buffered but not in its bucket"
                self._book.budget.unbuffer(item.meta.nbytes)
            elif not self._production.take_back(job_id):
                queued.add(job_id)
            self._states.move(job_id, JobState.ACKED)
            self._ledger.add(job_id)
        self._book.queue.remove(queued)
        self._production.buffer_changed()

    def _ack_kept(self, keep: set[int]) -> None:
        """Ack the leases whose jobs a checkpoint already holds (trained before their ack arrived)."""
        for d in self.leases.drafters():
            for lease in self.leases.of(d):
                if lease.item.meta.job_id in keep:
                    self._ack_one(lease.item.meta.job_id)


class RoundTracker:
    """Each drafter's round (global step) and the items it took in it (the rules above)."""

    def __init__(self, accum: int = 1, ranks: int | None = None) -> None:
        assert accum >= 1, accum
        self.accum = accum
        self.ranks = ranks  # None: as many as have pulled since the last reset
        self._round: dict[int, int] = {}
        self._taken: dict[int, int] = {}  # items in the drafter's current round
        self._base = 0

    def round(self, drafter_id: int) -> int:
        return self._round.setdefault(drafter_id, self._base)

    @property
    def step_items(self) -> int:
        """Items of one global step: ranks x grad_accum."""
        return max(1, self.ranks or len(self._round)) * self.accum

    def open_slots(self) -> dict[int, int]:
        """round -> items its ranks may still pull in it."""
        out: dict[int, int] = {}
        for d, r in self._round.items():
            out[r] = out.get(r, 0) + self.accum - self._taken.get(d, 0)
        return out

    def slots_in(self, rnd: int) -> dict[int, int]:
        """rank -> items it will still pull in round `rnd` (ranks not seen yet count as -1, -2, ...)."""
        out = {}
        for d, r in self._round.items():
            out[d] = self.accum - self._taken.get(d, 0) if r == rnd else (self.accum if r < rnd else 0)
        for k in range(max(0, (self.ranks or 0) - len(out))):
            out[-1 - k] = self.accum
        return out

    def took(self, drafter_id: int) -> None:
        r = self.round(drafter_id)
        n = self._taken.get(drafter_id, 0) + 1
        if n >= self.accum:
            self._round[drafter_id], n = r + 1, 0
        self._taken[drafter_id] = n

    def step_ended(self, drafter_id: int) -> None:
        """The drafter got Drained: it steps now, whatever it holds."""
        self._round[drafter_id] = self.round(drafter_id) + 1
        self._taken[drafter_id] = 0

    def untake(self, drafter_id: int) -> None:
        """The drafter's last item is lost and it pulls again for the same slot."""
        n = self._taken.get(drafter_id, 0)
        if n > 0:
            self._taken[drafter_id] = n - 1
        elif self.round(drafter_id) > self._base:
            self._round[drafter_id] -= 1
            self._taken[drafter_id] = self.accum - 1

    def restart(self, drafter_id: int) -> None:
        """One drafter restarted on its own: it joins the others' current round."""
        others = [r for d, r in self._round.items() if d != drafter_id]
        self._round[drafter_id] = max(others, default=self._base)
        self._taken[drafter_id] = 0

    def reset(self) -> None:
        """A rebuilt group: every rank starts a fresh round, past every round seen."""
        self._base = max(self._round.values(), default=self._base) + 2
        self._round.clear()
        self._taken.clear()
