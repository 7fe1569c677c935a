"""The pool policy's parts, each on its own: states, queue, in-flight table, buffer, leases, budget, ledger."""
from __future__ import annotations

import random

import pytest

from app.messages import ItemMeta
from app.pool.book import InFlight, JobQueue, JobState, JobStates, Ledger
from app.pool.holdings import BucketBuffer, Budget, Item, LeaseTable
from app.pool.pull_policy import PullContext, RoundRobin, make_pull_policy
from tests.pool_helpers import job


def item(i: int, bucket: int = 0, nbytes: int = 100) -> Item:
    return Item(job(i, bucket), ItemMeta(i, bucket, 1, 10, 8, nbytes, 0, 0.0), payload=f"ref{i}")


def test_job_states_follow_the_life_cycle_and_count_each_state():
    s = JobStates()
    for jid in range(3):
        s.move(jid, JobState.PENDING)
    s.move(0, JobState.IN_FLIGHT)
    s.move(0, JobState.BUFFERED)
    s.move(0, JobState.LEASED)
    s.move(0, JobState.ACKED)
    s.move(1, JobState.IN_FLIGHT)
    s.move(1, JobState.PENDING)  # its target failed
    s.move(7, JobState.ACKED)  # restored from a checkpoint, never added
    assert s.counts() == {"pending": 2, "in_flight": 0, "buffered": 0, "leased": 0, "acked": 2, "quarantined": 0}
    assert len(s) == 4 and s.get(0) is JobState.ACKED and 5 not in s
    s.move(0, JobState.PENDING)  # rolled back
    assert s.count(JobState.ACKED) == 1


@pytest.mark.parametrize("path", [[JobState.BUFFERED], [JobState.PENDING, JobState.LEASED],
                                  [JobState.PENDING, JobState.IN_FLIGHT, JobState.ACKED]])
def test_an_illegal_transition_is_an_assertion(path):
    s = JobStates()
    with pytest.raises(AssertionError, match="illegal transition"):
        for state in path:
            s.move(1, state)


def test_queue_puts_returned_jobs_in_front_in_the_given_order():
    q = JobQueue()
    for i in range(5):
        q.append(job(i))
    q.pop(), q.pop()
    q.push_front([0, 1])  # ids: the queue makes JobSpecs from its catalog
    q.remove({3})
    assert [q.pop().job_id for _ in range(len(q))] == [0, 1, 2, 4]
    assert q.peek() is None


def test_in_flight_counts_per_target():
    fl = InFlight()
    fl.start(job(1), 0, 1.0, 10)
    fl.start(job(2), 0, 2.0, 10)
    fl.start(job(3), 1, 3.0, 10)
    assert (fl.count(0), fl.count(1), fl.count(2), len(fl)) == (2, 1, 0, 3)
    assert sorted(fl.of_target(0)) == [1, 2]
    assert fl.pop(1).target_id == 0 and fl.count(0) == 1
    assert fl.by_target() == {0: [(2, 2.0)], 1: [(3, 3.0)]}
    with pytest.raises(AssertionError):
        fl.start(job(3), 1, 4.0, 10)


def test_buffer_takes_a_random_item_of_the_bucket():
    buf = BucketBuffer(3)
    for i in range(6):
        buf.put(item(i, bucket=i % 2))
    assert buf.counts() == [3, 3, 0] and buf.nonempty() == [0, 1] and len(buf) == 6
    rng = random.Random(0)
    taken = {buf.take(0, rng).meta.job_id for _ in range(3)}
    assert taken == {0, 2, 4} and buf.counts() == [0, 3, 0]
    with pytest.raises(AssertionError):
        buf.take(0, rng)


def test_leases_and_generation_fences():
    t = LeaseTable()
    t.lease(item(1), 0, 2.0)
    t.lease(item(2), 0, 1.0)
    t.lease(item(3), 1, 3.0)
    assert [ls.item.meta.job_id for ls in t.of(0)] == [2, 1]  # oldest first
    assert t.holder(3) == 1 and t.holder(9) is None and t.count_by_drafter() == {0: 2, 1: 1}
    fence = t.fence(0)
    t.bump(0)
    assert t.fence(0) != fence and t.generation(0) == 1 and t.generation(1) == 0
    fence1 = t.fence(1)
    t.bump_group()
    assert t.fence(1) != fence1
    t.see(5)
    assert t.drafters() == [0, 1, 5]
    assert t.pop(1).drafter_id == 0 and len(t) == 2


def test_budget_counts_items_bytes_reservations_and_overshoot():
    b = Budget(capacity_items=3, capacity_bytes=1000, num_buckets=2)
    assert b.reservation(job(1, 0, est=300)) == 300
    b.reserve(300)
    b.land(300, 400, 0)  # larger than reserved
    assert (b.buffered, b.reserved, b.overshoot) == (400, 0, 1)
    assert b.reservation(job(2, 0, est=100)) == 400  # the largest payload seen in the bucket
    assert b.reservation(job(3, 1, est=100)) == 100
    b.lease(400)
    assert b.total == 400 and b.fits(2, 600) and not b.fits(2, 601) and not b.fits(3, 0)
    b.unlease(400)
    assert b.total == 0


def test_ledger_interface():
    led = Ledger()
    for i in (5, 1, 3):
        led.add(i)
    led.discard(3)
    assert led.ids() == [1, 5] and 5 in led and 3 not in led and len(led) == 2
    assert led.not_in([1]) == [5]


def ctx(drafter: int, counts: list[int], rnd: int = 0, step_items: int = 12, finished: bool = False) -> PullContext:
    return PullContext(drafter, rnd, counts, step_items, finished)


def test_round_robin_serves_every_nonempty_bucket_in_turn_per_drafter():
    rr = make_pull_policy("round_robin", 4)
    assert isinstance(rr, RoundRobin)
    rng = random.Random(0)
    assert [rr.choose(ctx(0, [1, 0, 5, 2]), rng) for _ in range(4)] == [0, 2, 3, 0]
    assert rr.choose(ctx(1, [0, 0, 5, 2]), rng) == 2  # per-drafter cursor
    rr.reset()
    assert rr.choose(ctx(0, [1, 1, 1, 1]), rng) == 0
