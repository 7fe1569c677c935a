"""The drafters' side of the pool: what one pull gets. End-of-stream once every job is acked; nothing
(wait) while the reservoir holds fewer than `min_ready` items; a drained step when nothing more
will come for it; else one buffered item, from the bucket the pull policy picks for this drafter's
round of the global step, leased to the drafter (`lending.py`).
"""
from __future__ import annotations

import random
from collections.abc import Callable

from app.messages import Drained, EndOfStream, PulledItem
from app.pool.holdings import BucketBuffer
from app.pool.lending import Lending
from app.pool.production import Production
from app.pool.pull_policy import PullContext, PullPolicy
from app.pool.rounds import RoundTracker
from app.pool.telemetry import PoolTelemetry


class Serving:
    """Pulls over the pool's shared buffer, rounds, policy, leases and telemetry (`HSPool` owns them);
    asks `finished` (every job produced) and `done` (every job acked) of the pool, calls `changed`
    after each lease and `buffer_changed` when an item left the buffer."""

    def __init__(self, min_ready: int, seed: int, policy: PullPolicy, rounds: RoundTracker, buffer: BucketBuffer,
                 lending: Lending, production: Production, tel: PoolTelemetry, eos_drafters: set[int],
                 clock: Callable[[], float], finished: Callable[[], bool], done: Callable[[], bool],
                 changed: Callable[[], None], buffer_changed: Callable[[], None]) -> None:
        self._min_ready, self._rng = min_ready, random.Random(seed)
        self._policy, self._rounds, self._buffer, self._lending = policy, rounds, buffer, lending
        self._production, self._tel, self._eos_drafters, self._clock = production, tel, eos_drafters, clock
        self._finished, self._done, self._changed, self._buffer_changed = finished, done, changed, buffer_changed

    def try_pull(self, drafter_id: int) -> PulledItem | EndOfStream | Drained | None:
        """Lease one item to the drafter; None means wait (the reservoir is not ready)."""
        if self._done():
            self._eos_drafters.add(drafter_id)
            return EndOfStream()
        buffered = len(self._buffer)
        finished = self._finished()
        draining = finished or self._production.stalled()
        if buffered == 0:
            # Also drain when leases hold the byte budget and nothing is in flight: the rank must
            # step with what it has and ack, or its own leases would block the next job forever.
            return self._drained(drafter_id) if draining else None
        if buffered < self._min_ready and not draining:
            return None
        rnd = self._rounds.round(drafter_id)
        ctx = PullContext(drafter_id, rnd, self._buffer.counts(), self._rounds.step_items, finished,
                          self._rounds.open_slots(), self._rounds.ranks is not None, self._buffer.mean_costs(),
                          self._rounds.slots_in(rnd))
        bucket = self._policy.choose(ctx, self._rng)
        if bucket is None:  # the policy ends this step early (equal steps over the last items)
            return self._drained(drafter_id)
        item = self._buffer.take(bucket, self._rng,
                                 self._policy.pick(ctx, bucket, self._buffer.costs(bucket), self._rng))
        self._policy.served(ctx, bucket, item.job.cost)
        self._lending.lend(item, drafter_id, self._clock())
        self._rounds.took(drafter_id)
        self._tel.served[bucket] += 1
        self._buffer_changed()
        self._changed()  # a freed item slot may let a job be issued
        return PulledItem(meta=item.meta, payload_ref=item.payload)

    def _drained(self, drafter_id: int) -> Drained:
        self._rounds.step_ended(drafter_id)
        return Drained()
