"""The pool policy without Ray: fairness, capacity, reservoir, leases, completion, ledger."""
from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.config.schema import PoolConfig
from app.messages import EndOfStream, PulledItem
from app.bench.feeding.pull_policies import RandomPulls, TracedPulls
from app.pool.hs_pool import Drained, HSPool, LeaseRevoked
from app.pool.pull_policy import RoundRobin
from tests.pool_helpers import job, meta_for


def produce_all(pool: HSPool, targets: int = 8) -> int:
    """Issue and finish jobs until nothing more is issued; returns how many landed."""
    n = 0
    while True:
        issued = [(t, pool.next_job(t)) for t in range(targets)]
        issued = [(t, j) for t, j in issued if j is not None]
        if not issued:
            return n
        for t, j in issued:
            assert pool.job_done(t, meta_for(j, t), payload=f"ref{j.job_id}")
            n += 1


def make_pool(**kw) -> HSPool:
    num_buckets = kw.pop("num_buckets", 6)
    policy = kw.pop("pull_policy", None)  # None: the config's default (stratified)
    if policy == "random":
        policy = RandomPulls(num_buckets)
    return HSPool(PoolConfig(**kw), num_buckets, pull_policy=policy)


def test_round_robin_five_pulls_hit_five_different_buckets():
    counts = [2, 0, 1, 3, 2, 12]
    pool = make_pool(capacity=20, min_ready=6, jobs_in_flight_per_target=4, pull_policy="round_robin")
    jobs = [b for b, c in enumerate(counts) for _ in range(c)]
    pool.add_jobs(job(i, b) for i, b in enumerate(jobs))
    produce_all(pool)
    assert pool.stats().q_hsb == counts
    got = [pool.try_pull(0) for _ in range(5)]
    assert all(isinstance(g, PulledItem) for g in got)
    assert sorted(g.meta.bucket for g in got) == [0, 2, 3, 4, 5]


def test_random_policy_favours_the_dominant_bucket():
    counts = [2, 0, 1, 3, 2, 12]
    pool = make_pool(capacity=20, min_ready=6, jobs_in_flight_per_target=4, pull_policy="random", seed=3)
    jobs = [b for b, c in enumerate(counts) for _ in range(c)]
    pool.add_jobs(job(i, b) for i, b in enumerate(jobs))
    produce_all(pool)
    got = [pool.try_pull(0).meta.bucket for _ in range(5)]
    assert len(set(got)) < 5  # 12/20 of the mass is bucket 5: repeats are near certain (seeded)


def test_served_share_tracks_produced_share_over_a_long_run():
    rng = random.Random(1)
    weights = [1, 1, 2, 2, 3, 9]  # the longest bucket dominates
    buckets = rng.choices(range(6), weights=weights, k=6000)
    pool = make_pool(capacity=24, min_ready=6, jobs_in_flight_per_target=2)
    pool.add_jobs(job(i, b) for i, b in enumerate(buckets))
    pool.finish_adding()
    checkpoints = {1000, 2500, 4000}
    pulled = 0
    while not pool.done:
        produce_all(pool, targets=5)
        got = pool.try_pull(pulled % 3)
        if isinstance(got, PulledItem):
            pool.ack(pulled % 3, [got.meta.job_id])
            pulled += 1
            if pulled in checkpoints:
                st_ = pool.stats()
                for b in range(6):
                    served = st_.served_per_bucket[b] / pulled
                    produced = st_.produced_per_bucket[b] / sum(st_.produced_per_bucket)
                    assert abs(served - produced) < 0.01, (b, served, produced)
    st_ = pool.stats()
    assert st_.served_per_bucket == st_.produced_per_bucket == [buckets.count(b) for b in range(6)]


def test_min_ready_waits_then_drains_then_drained_then_eos():
    pool = make_pool(capacity=10, min_ready=6, jobs_in_flight_per_target=1)
    pool.add_jobs(job(i, i % 3) for i in range(8))
    for t in range(5):  # five jobs land, three stay pending
        j = pool.next_job(t)
        pool.job_done(t, meta_for(j, t), None)
    assert pool.try_pull(0) is None  # 5 < min_ready and more is coming
    j = pool.next_job(0)
    pool.job_done(0, meta_for(j, 0), None)
    first = pool.try_pull(0)
    assert isinstance(first, PulledItem)  # 6 buffered: ready
    assert pool.try_pull(0) is None  # 5 again
    pool.finish_adding()
    assert pool.try_pull(0) is None  # two jobs still pending
    produce_all(pool)
    assert pool.producing_finished
    leased = [pool.try_pull(1) for _ in range(7)]  # drains below min_ready
    assert all(isinstance(x, PulledItem) for x in leased)
    assert isinstance(pool.try_pull(1), Drained)  # all produced, none buffered, leases out
    pool.ack(1, [x.meta.job_id for x in leased])
    assert isinstance(pool.try_pull(2), Drained)  # drafter 0 still holds one lease
    pool.ack(0, [first.meta.job_id])
    assert pool.done
    assert isinstance(pool.try_pull(2), EndOfStream)
    assert pool.ledger() == list(range(8))


def test_byte_cap_counts_leases_and_a_stalled_pool_drains_below_min_ready():
    pool = make_pool(capacity=20, capacity_bytes=1000, min_ready=6, jobs_in_flight_per_target=10)
    pool.add_jobs(job(i, 0, est=300) for i in range(10))
    assert produce_all(pool) == 3  # 900 bytes; a fourth would make 1200
    a = pool.try_pull(0)
    b = pool.try_pull(0)  # stalled: nothing in flight and the next job does not fit
    assert isinstance(a, PulledItem) and isinstance(b, PulledItem)
    assert pool.next_job(1) is None  # leased bytes still count
    assert pool.pool_bytes == 900
    pool.ack(0, [a.meta.job_id])
    assert pool.next_job(1) is not None and pool.pool_bytes == 900


def test_job_failed_and_target_lost_go_to_the_front():
    pool = make_pool(capacity=20, min_ready=1, jobs_in_flight_per_target=3)
    pool.add_jobs(job(i, 0) for i in range(10))
    a, b, c = pool.next_job(0), pool.next_job(0), pool.next_job(1)
    assert pool.job_failed(0, b.job_id)
    assert pool.next_job(2).job_id == b.job_id
    assert pool.target_lost(0) == [a.job_id]
    assert pool.next_job(2).job_id == a.job_id
    # a late result from the lost target is dropped, not buffered
    assert not pool.job_done(0, meta_for(a, 0), None)
    assert pool.stats().stale_results == 1 and pool.stats().buffered == 0
    assert c.job_id == 2


def test_release_returns_leases_to_the_front_in_order_and_ignores_stale_acks():
    pool = make_pool(capacity=20, min_ready=1, jobs_in_flight_per_target=10)
    pool.add_jobs(job(i, i % 2) for i in range(12))
    for _ in range(4):
        j = pool.next_job(0)
        pool.job_done(0, meta_for(j, 0), None)
    pulled = [pool.try_pull(5).meta.job_id for _ in range(3)]
    assert pool.release(5) == pulled
    assert [pool.next_job(1).job_id for _ in range(3)] == pulled
    assert pool.ack(5, pulled) == 0 and pool.stats().stale_acks == 3
    assert pool.stats().leased == 0


def test_ack_twice_is_counted_not_fatal():
    pool = make_pool(capacity=20, min_ready=1)
    pool.add_jobs([job(0, 0)])
    pool.job_done(0, meta_for(pool.next_job(0), 0), None)
    pool.try_pull(0)
    assert pool.ack(0, [0]) == 1
    assert pool.ack(0, [0]) == 0
    assert pool.stats().acked_twice == 1 and pool.ledger() == [0]


def test_restored_ledger_is_never_issued_again():
    pool = make_pool(capacity=20, min_ready=1, jobs_in_flight_per_target=20)
    pool.restore_ledger([1, 3, 5])
    pool.add_jobs(job(i, 0) for i in range(6))
    pool.finish_adding()
    issued = []
    while (j := pool.next_job(0)) is not None:
        issued.append(j.job_id)
    assert issued == [0, 2, 4]
    st_ = pool.stats()
    assert st_.total_jobs == 6 and st_.acked == 3


def test_bad_jobs_name_the_fix():
    pool = make_pool(capacity_bytes=1000)
    with pytest.raises(ValueError, match="bucket 7"):
        pool.add_jobs([job(0, 7)])
    with pytest.raises(ValueError, match="capacity_bytes"):
        pool.add_jobs([job(1, 0, est=5000)])
    pool.add_jobs([job(2, 0)])
    with pytest.raises(ValueError, match="added twice"):
        pool.add_jobs([job(2, 0)])


class Sim:
    """Random targets, failures, drafters, releases over one pool; checks invariants each op."""

    def __init__(self, seed: int, n_jobs: int = 120, cap: int = 8, cap_bytes: int = 3000) -> None:
        self.rng = random.Random(seed)
        self.pool = make_pool(
            capacity=cap, capacity_bytes=cap_bytes, min_ready=3, jobs_in_flight_per_target=2, seed=seed
        )
        self.jobs = {i: job(i, self.rng.randrange(6), est=self.rng.randrange(50, 600)) for i in range(n_jobs)}
        self.pool.add_jobs(self.jobs.values())
        self.pool.finish_adding()
        self.held: dict[int, list[int]] = {d: [] for d in range(3)}
        self.n_jobs = n_jobs

    def step(self, op: int) -> None:
        p, rng = self.pool, self.rng
        t = rng.randrange(5)
        if op == 0:
            p.next_job(t)
        elif op == 1:  # a random in-flight job lands with nbytes <= its estimate
            fl = p.stats().in_flight_by_target
            if fl:
                t = rng.choice(sorted(fl))
                jid = rng.choice(fl[t])[0]
                j = self.jobs[jid]
                p.job_done(t, meta_for(j, t, rng.randrange(0, j.est_bytes + 1)), None)
        elif op == 2:
            fl = p.stats().in_flight_by_target.get(t)
            if fl:
                p.job_failed(t, fl[0][0])
        elif op == 3 and rng.random() < 0.3:
            p.target_lost(t)
        elif op == 4:
            d = rng.randrange(3)
            got = p.try_pull(d)
            if isinstance(got, PulledItem):
                self.held[d].append(got.meta.job_id)
        elif op == 5:
            d = rng.randrange(3)
            if len(self.held[d]) >= 2 or p.producing_finished:
                p.ack(d, self.held[d])
                self.held[d] = []
        elif op == 6 and rng.random() < 0.2:
            d = rng.randrange(3)
            p.release(d)
            self.held[d] = []
        self.check()

    def check(self) -> None:
        s = self.pool.stats()
        assert s.buffered + s.in_flight <= s.capacity_items
        assert s.pool_bytes <= s.capacity_bytes
        assert s.pending + s.in_flight + s.buffered + s.leased + s.acked == s.total_jobs == self.n_jobs
        assert sum(s.q_hsb) == s.buffered

    def run_to_end(self) -> None:
        for _ in range(200_000):
            if self.pool.done:
                return
            self.step(self.rng.randrange(7))
        raise AssertionError(f"no progress: {self.pool.stats()}")


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), ops=st.lists(st.integers(0, 6), min_size=1, max_size=300))
def test_capacity_in_items_and_bytes_is_never_exceeded(seed, ops):
    sim = Sim(seed)
    for op in ops:
        sim.step(op)


@pytest.mark.parametrize("seed", range(8))
def test_random_failures_and_releases_still_ack_every_job_exactly_once(seed):
    sim = Sim(seed)
    sim.run_to_end()
    assert sim.pool.ledger() == list(range(sim.n_jobs))
    assert sim.pool.stats().acked_twice == 0
    assert sim.pool.stats().bytes_overshoot == 0


def test_eos_reaches_every_drafter_exactly_once_and_again_after_a_rebuild():
    pool = make_pool(capacity=6, min_ready=2, jobs_in_flight_per_target=1)
    pool.add_jobs(job(i, i % 6) for i in range(40))
    pool.finish_adding()
    eos_count = {d: 0 for d in range(3)}

    async def target(t: int) -> None:
        while not pool.producing_finished:
            j = pool.next_job(t)
            if j is None:
                await pool.wait_changed()
                continue
            await asyncio.sleep(0)
            pool.job_done(t, meta_for(j, t), None)

    async def drafter(d: int) -> None:
        held = []
        while True:
            got = await pool.pull(d)
            if isinstance(got, EndOfStream):
                eos_count[d] += 1
                return
            if isinstance(got, PulledItem):
                held.append(got.meta.job_id)
            if len(held) == 2 or isinstance(got, Drained):
                pool.ack(d, held)
                held = []
                await asyncio.sleep(0)

    async def main() -> None:
        await asyncio.gather(*(target(t) for t in range(5)), *(drafter(d) for d in range(3)))

    asyncio.run(main())
    assert eos_count == {0: 1, 1: 1, 2: 1}
    assert pool.eos_drafters() == [0, 1, 2]
    assert pool.ledger() == list(range(40))
    pool.reset_drafters()
    assert pool.eos_drafters() == []
    assert isinstance(pool.try_pull(1), EndOfStream) and pool.eos_drafters() == [1]


def test_a_waiting_pull_is_fenced_by_release():
    pool = make_pool(capacity=6, min_ready=1)
    pool.add_jobs([job(0, 0)])

    async def main():
        waiting = asyncio.ensure_future(pool.pull(7))
        await asyncio.sleep(0)
        pool.release(7)  # the drafter died while its pull waited
        pool.job_done(0, meta_for(pool.next_job(0), 0), None)
        with pytest.raises(LeaseRevoked):
            await waiting
        assert pool.stats().buffered == 1  # the item was not leased to the dead drafter
        got = await pool.pull(7, pool.generation(7))  # the restarted drafter, at its new generation, pulls
        assert isinstance(got, PulledItem)
        assert pool.stats().pull_waits.count == 1

    asyncio.run(main())


def _window_covers_available(policy: str, seed: int, steps: int = 3000) -> float:
    """Drafter 0 pulls in 4-pull windows while drafters 1-2 and targets interleave at random;
    share of windows covering min(4, buckets non-empty at every one of drafter 0's pulls)."""
    rng = random.Random(seed)
    traced = TracedPulls(RoundRobin(6) if policy == "round_robin" else RandomPulls(6))
    pool = HSPool(PoolConfig(capacity=14, min_ready=3, jobs_in_flight_per_target=2, seed=seed), 6,
                  pull_policy=traced)
    pool.add_jobs(job(i, rng.choices(range(6), weights=[1, 1, 1, 1, 2, 6])[0]) for i in range(steps))
    for _ in range(steps):
        for t in range(5):
            if rng.random() < 0.3 and (j := pool.next_job(t)) is not None:
                pool.job_done(t, meta_for(j, t), None)
        d = rng.randrange(3)
        got = pool.try_pull(d)
        if isinstance(got, PulledItem):
            pool.ack(d, [got.meta.job_id])
    mine = [(b, m) for d, b, m in traced.trace if d == 0]
    windows = [mine[i : i + 4] for i in range(0, len(mine) - 3, 4)]
    ok = 0
    for w in windows:
        avail = w[0][1]
        for _, m in w[1:]:
            avail &= m
        ok += len({b for b, _ in w}) >= min(4, bin(avail).count("1"))
    assert len(windows) > 100
    return ok / len(windows)


@pytest.mark.parametrize("seed", range(3))
def test_fair_pulls_cover_every_bucket_available_throughout_a_window(seed):
    # Round-robin over non-empty buckets cannot skip a bucket that stays non-empty, so a 4-pull
    # window always covers min(4, buckets available at each of its pulls): exactly 1.0.
    assert _window_covers_available("round_robin", seed) == 1.0
    assert _window_covers_available("random", seed) < 0.6


def test_rollback_requeues_leases_and_jobs_acked_after_the_checkpoint():
    pool = make_pool(capacity=20, min_ready=1, jobs_in_flight_per_target=20)
    all_jobs = [job(i, i % 3) for i in range(8)]
    pool.add_jobs(all_jobs)
    pool.finish_adding()
    produce_all(pool, targets=1)
    got = [pool.try_pull(0).meta.job_id for _ in range(6)]
    pool.ack(0, got[:2])  # checkpoint ledger
    pool.ack(0, got[2:4])  # acked after the checkpoint
    n = pool.rollback(got[:2])
    assert n == 4  # two leases + two post-checkpoint acks
    assert pool.ledger() == sorted(got[:2])
    s = pool.stats()
    assert s.leased == 0 and s.pending == 4 and s.buffered == 2
    produce_all(pool, targets=1)
    while not pool.done:
        g = pool.try_pull(1)
        pool.ack(1, [g.meta.job_id])
    assert pool.ledger() == list(range(8)) and pool.stats().acked_twice == 0


def test_rollback_fences_a_waiting_pull_of_a_drafter_that_held_no_lease():
    import asyncio

    async def scenario():
        pool = make_pool(capacity=20, min_ready=2, jobs_in_flight_per_target=20)
        pool.add_jobs([job(i, 0) for i in range(4)])
        pool.finish_adding()
        waiting = asyncio.create_task(pool.pull(1))  # drafter 1 waits for the reservoir, holds nothing
        await asyncio.sleep(0)
        pool.rollback([])
        produce_all(pool, targets=1)
        with pytest.raises(LeaseRevoked):
            await waiting
        assert pool.stats().leased == 0  # nothing leased to the dead drafter

    asyncio.run(scenario())


def test_pull_drains_when_its_own_leases_hold_the_byte_budget():
    # Three items fit the byte cap; a rank accumulating four would otherwise wait forever.
    pool = make_pool(capacity=20, min_ready=1, jobs_in_flight_per_target=20, capacity_bytes=3 * 100)
    pool.add_jobs([job(i, 0, est=100) for i in range(8)])
    pool.finish_adding()
    got = []
    for _ in range(3):
        j = pool.next_job(0)
        assert pool.job_done(0, meta_for(j, 0), payload=f"ref{j.job_id}")
        got.append(pool.try_pull(0))
    assert pool.next_job(0) is None  # the three leases hold the whole byte budget
    assert all(isinstance(g, PulledItem) for g in got)
    assert isinstance(pool.try_pull(0), Drained)  # step with three, ack, then production resumes
    pool.ack(0, [g.meta.job_id for g in got])
    assert pool.next_job(0) is not None


def test_a_lost_payload_requeues_only_that_job():
    pool = make_pool(capacity=20, min_ready=1, jobs_in_flight_per_target=20)
    pool.add_jobs([job(i, i % 2) for i in range(4)])
    pool.finish_adding()
    produce_all(pool, targets=1)
    a, b = pool.try_pull(0), pool.try_pull(1)
    assert not pool.payload_lost(1, a.meta.job_id)  # not drafter 1's lease: ignored
    assert pool.payload_lost(0, a.meta.job_id)
    s = pool.stats()
    assert (s.pending, s.leased, s.lost_payloads) == (1, 1, 1) and pool.pool_bytes == s.pool_bytes
    produce_all(pool, targets=1)
    pool.ack(1, [b.meta.job_id])
    while not pool.done:
        g = pool.try_pull(0)
        pool.ack(0, [g.meta.job_id])
    assert pool.ledger() == [0, 1, 2, 3] and pool.stats().acked_twice == 0


def test_a_pull_sent_by_a_released_incarnation_is_refused():
    async def scenario():
        pool = make_pool(capacity=20, min_ready=1, jobs_in_flight_per_target=20)
        pool.add_jobs([job(i, 0) for i in range(4)])
        pool.finish_adding()
        produce_all(pool, targets=1)
        await pool.pull(0)  # the old incarnation of drafter 0 leased one item...
        pool.release(0)  # ...died, and was released
        with pytest.raises(LeaseRevoked):
            await pool.pull(0)  # a call it sent before dying runs late: it takes nothing
        assert pool.stats().leased == 0
        got = await pool.pull(0, pool.generation(0))  # the restarted drafter 0 pulls normally
        assert isinstance(got, PulledItem)

    asyncio.run(scenario())
