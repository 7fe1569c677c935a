"""Several drafter runs on one capture stream (app/pool/stream.py), without Ray: one forward per job for
every run, the shared ref counted once, exactly-once per run, and a slow run holding the others back only
up to the budget."""
from __future__ import annotations

import random

import pytest

from app.config.schema import PoolConfig
from app.messages import Drained, EndOfStream, PulledItem
from app.pool.stream import RunShape, SharedStream
from tests.pool_helpers import job, meta_for


def stream(runs=("a", "b"), **kw) -> SharedStream:
    cfg = PoolConfig(**{"capacity": 8, "min_ready": 0, "jobs_in_flight_per_target": 2, **kw})
    return SharedStream(cfg, 2, {r: RunShape(ranks=1, accum=1) for r in runs}, pull_policy="round_robin")


def produce(s: SharedStream, targets: int = 2) -> list[int]:
    """Issue and land jobs until nothing more is issued; the job ids of the forwards, in order."""
    out = []
    while True:
        issued = [(t, s.next_job(t)) for t in range(targets)]
        issued = [(t, j) for t, j in issued if j is not None]
        if not issued:
            return out
        for t, j in issued:
            assert s.job_done(t, meta_for(j, t), payload=f"ref{j.job_id}")
            out.append(j.job_id)


def train(s: SharedStream, run: str, steps: int | None = None) -> list[int]:
    """One rank of `run` pulls and acks at once until end-of-stream (or `steps` items); the ids it trained."""
    pool, got = s.pool(run), []
    while steps is None or len(got) < steps:
        item = pool.try_pull(0)
        if isinstance(item, EndOfStream) or item is None:
            break
        if isinstance(item, Drained):
            continue
        assert isinstance(item, PulledItem)
        assert item.payload_ref == f"ref{item.meta.job_id}"  # the one forward's ref, shared
        pool.ack(0, [item.meta.job_id])
        got.append(item.meta.job_id)
    return got


@pytest.mark.parametrize("runs", [("a", "b"), ("",)], ids=["two runs", "a single run"])
def test_every_job_is_produced_once_and_trained_once_by_each_run(runs):
    """A single run is a stream of one run, named "" (the pool actor's one mode): the same road."""
    s = stream(runs)
    s.add_jobs(job(i, i % 2) for i in range(20))
    s.finish_adding()
    forwards: list[int] = []
    trained: dict[str, list[int]] = {run: [] for run in runs}
    while not s.done:
        forwards += produce(s)
        for run in trained:
            trained[run] += train(s, run)
    assert sorted(forwards) == list(range(20))  # one forward per job, not one per run
    assert s.forwards == 20 and s.forwards_by_runs == {len(runs): 20}
    for run, ids in trained.items():
        assert sorted(ids) == list(range(20)), run
        assert s.pool(run).ledger() == list(range(20))
        assert s.pool(run).stats().acked_twice == 0
        assert s.pool(run).pool_bytes == 0  # its own budget: nothing buffered, leased or reserved
    assert s.held() == (0, 0)  # every ref dropped once every run acked it


def test_a_shared_ref_counts_once_against_the_item_budget():
    s = stream(capacity=4)
    s.add_jobs(job(i) for i in range(10))
    assert len(produce(s)) == 4  # 4 items held by both runs: 4 against the budget, not 8
    assert s.held() == (4, 400)
    assert s.pool("a").stats().buffered == 4 and s.pool("b").stats().buffered == 4


def test_a_shared_ref_counts_once_against_the_byte_budget():
    s = stream(capacity=100, capacity_bytes=350)
    s.add_jobs(job(i) for i in range(10))
    assert len(produce(s)) == 3  # 3 x 100 bytes held once: a fourth would pass 350
    assert s.held() == (3, 300)


def test_the_fast_run_waits_for_a_slow_one_only_up_to_the_budget():
    s = stream(capacity=4)
    s.add_jobs(job(i) for i in range(12))
    s.finish_adding()
    produce(s)
    assert len(train(s, "a")) == 4  # run a trains what is there; b has not pulled
    assert produce(s) == []  # b's buffer holds the whole budget: nothing more for a
    assert s.pool("a").try_pull(0) is None  # a waits (holds no lease: it does not step on nothing)
    assert len(train(s, "b", steps=2)) == 2  # b catches up by two
    assert len(produce(s)) == 2  # two more forwards, for both runs
    assert s.pool("a").stats().buffered == 2 and s.pool("b").stats().buffered == 4


def test_a_run_holding_leases_in_a_full_shared_budget_drains_and_one_holding_none_waits():
    s = stream(capacity=100, capacity_bytes=300)
    s.add_jobs(job(i) for i in range(12))
    s.finish_adding()
    assert len(produce(s)) == 3  # 300 bytes, shared by both runs
    a, b = s.pool("a"), s.pool("b")
    pulled = [a.try_pull(0) for _ in range(3)]
    a.ack(0, [p.meta.job_id for p in pulled[:2]])  # a keeps one lease (half a step)
    assert s.held() == (3, 300)  # b still holds all three: the shared budget is full
    assert a.stats().pool_bytes == 100  # a's own budget has room: only the shared one blocks
    # a's lease is part of what holds the budget, nothing is in flight and nothing fits: a ends its step
    # (waiting would leave it holding the lease it acks only after the step)
    assert isinstance(a.try_pull(0), Drained)
    a.ack(0, [pulled[2].meta.job_id])
    assert a.try_pull(0) is None  # holding nothing, a waits for b instead of stepping on nothing
    train(s, "b")
    assert len(produce(s)) == 3 and isinstance(a.try_pull(0), PulledItem)


def test_a_rollback_of_one_run_reproduces_jobs_for_that_run_alone():
    s = stream()
    s.add_jobs(job(i) for i in range(6))
    s.finish_adding()
    produce(s)
    assert sorted(train(s, "a")) == list(range(6)) and sorted(train(s, "b")) == list(range(6))
    assert s.forwards == 6
    assert s.pool("b").rollback([0, 1, 2]) == 3  # b's checkpoint holds three jobs: 3, 4, 5 again for b
    again = produce(s)
    assert sorted(again) == [3, 4, 5] and s.forwards_by_runs == {2: 6, 1: 3}
    assert s.pool("a").stats().buffered == 0  # a does not train them twice
    assert sorted(train(s, "b")) == [3, 4, 5]
    assert s.done and s.pool("a").stats().acked_twice == 0


def test_a_dead_target_requeues_its_forward_for_every_run_waiting_for_it():
    s = stream()
    s.add_jobs(job(i) for i in range(4))
    first = s.next_job(0)
    assert first is not None and s.in_flight_count(0) == 1
    assert s.target_lost(0) == [first.job_id]
    assert s.in_flight_count(0) == 0
    again = s.next_job(1)
    assert again is not None and again.job_id == first.job_id  # back at the front of both queues
    assert s.job_done(1, meta_for(again, 1), payload=f"ref{again.job_id}")
    assert not s.job_done(0, meta_for(first, 0), payload="late")  # the dead target's late answer is stale
    assert s.pool("a").stats().buffered == 1 and s.pool("b").stats().buffered == 1


def test_random_interleavings_train_every_job_once_per_run():
    for seed in range(5):
        rng = random.Random(seed)
        s = stream(runs=("a", "b", "c"), capacity=5)
        s.add_jobs(job(i, i % 2) for i in range(30))
        s.finish_adding()
        trained = {r: [] for r in ("a", "b", "c")}
        for _ in range(2000):
            if s.done:
                break
            t = rng.randrange(2)
            j = s.next_job(t)
            if j is not None:
                s.job_done(t, meta_for(j, t), payload=f"ref{j.job_id}")
            run = rng.choice("abc")
            trained[run] += train(s, run, steps=rng.randrange(1, 3))
        assert s.done, seed
        for run, ids in trained.items():
            assert sorted(ids) == list(range(30)), (seed, run)
        assert s.forwards == 30, seed
