"""The stratified pull policy, its round tracking and the mixing measures, without Ray.

Whole-pipeline behaviour comes from the discrete-event simulation in app/bench/feeding/simulate.py: the real
HSPool on a virtual clock, lockstep drafter ranks that prefetch and ack on their next pull.
"""
from __future__ import annotations

import asyncio
import math
import random

import pytest

from app.bench.feeding.pull_policies import RandomPulls
from app.bench.feeding.simulate import SimSetup, schedule_of, simulate
from app.config.schema import PoolConfig
from app.messages import Drained, ItemMeta, JobSpec, PulledItem
from app.pool.sides import RoundTracker
from app.pool.hs_pool import HSPool, LeaseRevoked
from app.pool.pull_policy import PullContext, Stratified, apportion
from app.pool.telemetry import (BacklogMeter, StepMix, bucket_counts, shares_of, step_tv, step_tv_floor,
                                tail_single, tv_distance)
from tests.pool_helpers import job

DEMO_MIX = [1, 4, 5, 6, 7, 11]  # conf/tiny.yaml's jobs per bucket per epoch: the longest bucket dominates
DRAFTER_COST = [0.30, 0.25, 0.20, 0.15, 0.10, 0.05]  # s per item: short buckets cost the drafter more


def sim_setup(mix=DEMO_MIX, jobs=1200, supply=1.1, **kw) -> SimSetup:
    mean = sum(m * c for m, c in zip(mix, DRAFTER_COST)) / sum(mix)
    target = 5 * mean / (3 * supply)  # 5 targets make `supply` x what 3 drafters eat
    return SimSetup(mix, jobs, DRAFTER_COST, [target * (0.7 + 0.12 * b) for b in range(6)], **kw)


def land(pool: HSPool, j: JobSpec, target: int = 0) -> None:
    assert pool.job_done(target, ItemMeta(j.job_id, j.bucket, 1, 10, 8, 100, target, 0.0), None)


# ---- the policy in the pipeline ---------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
def test_served_share_tracks_the_schedule_share_within_two_steps_worth(seed):
    """After warm-up, at every step, each bucket's served count stays within two steps' worth of its
    share (2 x step_items x share, plus the one item a whole-item count cannot avoid)."""
    r = simulate(sim_setup(jobs=3000, seed=seed, jitter=0.3), "stratified")
    shares = shares_of(bucket_counts(r.schedule, 6))
    served = [0] * 6
    for n, step in enumerate(r.steps):
        served = [a + b for a, b in zip(served, step)]
        if n >= 2:
            total = sum(served)
            for b in range(6):
                assert abs(served[b] - shares[b] * total) <= 2 * r.step_items * shares[b] + 1, (n, b, served)


def test_round_robin_lets_the_dominant_bucket_fall_behind_by_more():
    r = simulate(sim_setup(jobs=1200, jitter=0.3), "round_robin")
    shares = shares_of(bucket_counts(r.schedule, 6))
    served, worst = [0] * 6, 0.0
    for step in r.steps:
        served = [a + b for a, b in zip(served, step)]
        worst = max(worst, abs(served[5] - shares[5] * sum(served)) - 2 * r.step_items * shares[5] - 1)
    assert worst > 0


def test_stratified_meets_the_mixing_targets_where_round_robin_and_random_do_not():
    setup = sim_setup(jobs=1200)
    m = simulate(setup, "stratified").measures()
    assert m["step_tv"] <= 1.15 * m["step_tv_floor"], m
    assert m["backlog"] <= 0.35 and m["tail_single"] == 0 and m["busy_min"] >= 0.97, m
    rr = simulate(setup, "round_robin").measures()
    rnd = simulate(setup, RandomPulls(6)).measures()
    assert rr["backlog"] > 0.7 and rr["step_tv"] > 1.3 * m["step_tv_floor"], rr
    assert rnd["step_tv"] > 1.5 * m["step_tv_floor"], rnd


@pytest.mark.parametrize("mix", [[3, 5, 10, 6, 4, 3], [1, 1, 1, 1, 2, 6]])
def test_other_mixes_stay_near_the_floor_and_end_mixed(mix):
    m = simulate(sim_setup(mix=mix, jobs=1200), "stratified").measures()
    assert m["step_tv"] <= 1.15 * m["step_tv_floor"] + 0.01 and m["tail_single"] == 0, m


def test_the_last_steps_split_what_is_left_evenly():
    for seed in range(4):
        r = simulate(sim_setup(mix=[3, 5, 10, 6, 4, 3], jobs=1201, seed=seed), "stratified")
        sizes = [sum(s) for s in r.steps]
        assert min(sizes[-3:]) >= r.step_items // 2, sizes[-6:]
        assert sum(sizes) == 1201


# ---- the policy on its own ----------------------------------------------------------------------

def ctx(counts, rnd=0, drafter=0, k=12, finished=False, slots=None) -> PullContext:
    return PullContext(drafter, rnd, counts, k, finished, slots or {}, True)


def test_apportion_is_largest_remainder():
    assert apportion([0.35, 1.41, 1.76, 2.12, 2.47, 3.88], 12) == [0, 1, 2, 2, 3, 4]
    assert apportion([-1.0, 2.0, 2.0], 3) == [0, 2, 1]
    assert apportion([0, 0], 3) == [2, 1]


def test_a_step_is_the_rounded_share_with_the_remainder_carried():
    pol = Stratified(6)
    pol.add_jobs(DEMO_MIX)
    rng = random.Random(0)
    full = [50] * 6
    steps = []
    for r in range(34):
        steps.append(bucket_counts((pol.choose(ctx(full, rnd=r), rng) for _ in range(12)), 6))
    # Over 34 steps (12 x 34 = 408 items = 12 x the 34-job mix) each bucket gets exactly its share.
    assert [sum(s[b] for s in steps) for b in range(6)] == [12 * m for m in DEMO_MIX]
    shares = shares_of(DEMO_MIX)
    assert step_tv(steps, shares) <= step_tv_floor(schedule_of(DEMO_MIX, 408), 12, 6, shares) + 1e-9


def test_with_a_backlogged_buffer_the_next_step_still_reaches_every_nonempty_bucket():
    # The seed's picture, q_hsb = [2, 0, 1, 3, 2, 12], against the data's shares.
    pool = HSPool(PoolConfig(capacity=20, min_ready=6, jobs_in_flight_per_target=20), 6, ranks=3, accum=4)
    held = [b for b, n in enumerate([2, 0, 1, 3, 2, 12]) for _ in range(n)]
    rest = [b for b, n in enumerate(DEMO_MIX) for _ in range(10 * n)]
    pool.add_jobs(job(i, b) for i, b in enumerate(held + rest))
    for i in range(20):
        land(pool, pool.next_job(0))
    assert pool.stats().q_hsb == [2, 0, 1, 3, 2, 12]
    got = [pool.try_pull(d).meta.bucket for _ in range(4) for d in range(3)]  # one global step
    assert set(got) == {0, 2, 3, 4, 5}
    assert got.count(5) <= 5  # not a step of the backlog


def test_reentering_production_after_the_drain_restores_the_data_shares():
    pol = Stratified(2)
    pol.add_jobs([1, 3])
    rng = random.Random(0)
    pol.choose(ctx([5, 1], finished=True), rng)
    assert pol.draining and pol.shares == [5 / 6, 1 / 6]
    pol.choose(ctx([5, 1], rnd=1, finished=False), rng)  # a lost payload re-queued a job
    assert not pol.draining and pol.shares == [0.25, 0.75]


def test_draining_ends_a_step_early_rather_than_leave_one_straggler():
    pol = Stratified(2)
    pol.add_jobs([1, 1])
    rng = random.Random(0)
    counts = [7, 6]  # 13 left, steps of 12: two steps of 7 and 6
    taken = 0
    while pol.choose(ctx(counts, finished=True, slots={0: 12}), rng) is not None:
        taken += 1
        counts = [counts[0] - 1, counts[1]] if counts[0] >= counts[1] else [counts[0], counts[1] - 1]
    assert taken == 7


# ---- rounds ------------------------------------------------------------------------------------

def test_rounds_follow_accum_drains_lost_payloads_and_rebuilds():
    rt = RoundTracker(accum=2, ranks=3)
    assert rt.step_items == 6
    rt.took(0), rt.took(0)
    assert rt.round(0) == 1 and rt.round(1) == 0
    rt.took(1)
    rt.untake(1)  # its payload was lost: it pulls again for the same slot
    rt.took(1), rt.took(1)
    assert rt.round(1) == 1
    rt.step_ended(2)  # Drained with nothing
    assert rt.round(2) == 1 and rt.open_slots() == {1: 6}
    rt.took(0)
    assert rt.open_slots() == {1: 5}
    rt.restart(2)
    assert rt.round(2) == 1
    rt.reset()
    assert {rt.round(d) for d in range(3)} == {3}  # past round 1, the newest seen


# ---- acks on pulls, rollback ---------------------------------------------------------------------

def test_acks_ride_on_the_next_pull_and_a_released_incarnation_acks_nothing():
    async def scenario():
        pool = HSPool(PoolConfig(capacity=20, min_ready=1, jobs_in_flight_per_target=20), 2)
        pool.add_jobs(job(i, i % 2) for i in range(6))
        for _ in range(6):
            land(pool, pool.next_job(0))
        a = await pool.pull(0)
        b = await pool.pull(0, 0, [a.meta.job_id])
        assert pool.ledger() == [a.meta.job_id]
        pool.release(0)
        with pytest.raises(LeaseRevoked):
            await pool.pull(0, 0, [b.meta.job_id])  # the dead incarnation's late call
        assert pool.ledger() == [a.meta.job_id] and pool.stats().pending == 1
    asyncio.run(scenario())


def test_rollback_acks_leases_the_checkpoint_already_holds():
    """Acks ride on the next pull, so a checkpoint can hold jobs the pool still sees leased."""
    pool = HSPool(PoolConfig(capacity=20, min_ready=1, jobs_in_flight_per_target=20), 2)
    pool.add_jobs(job(i, i % 2) for i in range(4))
    pool.finish_adding()
    for _ in range(4):
        land(pool, pool.next_job(0))
    got = [pool.try_pull(0).meta.job_id for _ in range(3)]
    assert pool.rollback(got[:2]) == 1  # two were trained into the checkpoint: acked, not re-queued
    assert pool.ledger() == sorted(got[:2]) and pool.stats().pending == 1 and pool.stats().acked_twice == 0


# ---- measures ----------------------------------------------------------------------------------

def test_tv_floor_tail_and_backlog():
    assert tv_distance([1, 1], [0.5, 0.5]) == 0 and tv_distance([2, 0], [0.5, 0.5]) == 0.5
    assert step_tv([[1, 1], [2, 0], [0, 0]], [0.5, 0.5]) == 0.25  # empty steps do not count
    assert step_tv_floor([0, 1, 0, 1, 0, 0], 2, 2) == pytest.approx((1 / 6 + 1 / 6 + 1 / 3) / 3)
    steps = [[1, 1]] * 17 + [[2, 0], [1, 1], [0, 3]]
    assert tail_single(steps) == pytest.approx(2 / 3)  # last 15% of 20 steps = 3 steps
    m = BacklogMeter()
    m.update(0.0, [3, 1])
    m.update(1.0, [1, 1])
    m.update(3.0, [0, 0])  # empty buffer: not averaged
    m.update(4.0, [4, 0], active=False)  # production over: not averaged
    assert m.value(10.0) == pytest.approx((0.75 + 2 * 0.5) / 3)
    assert math.isnan(BacklogMeter().value())


def test_step_mix_counts_a_step_once_every_rank_reported_it_and_survives_a_rollback():
    sm = StepMix(2)
    sm.add(1, [0]), sm.add(1, [1]), sm.add(2, [0, 0])
    assert sm.count == 0
    sm.add(3, [1])
    assert sm.count == 1 and sm.recent == [[1, 1]]
    sm.add(4, [])
    assert sm.count == 2 and sm.mean_tv([0.5, 0.5]) == pytest.approx(0.25)
    sm.add(2, [1])  # a rebuilt group repeats step 2
    sm.add(5, [0])
    assert sm.count == 3 and sm.recent[-1] == [0, 1]


def test_pool_stats_carry_the_mix_measures():
    r = simulate(sim_setup(jobs=300), "stratified")
    st = r.pool_stats
    assert st.data_shares == pytest.approx(shares_of(bucket_counts(r.schedule, 6)))
    assert st.steps_measured > 20 and 0 <= st.step_mix_tv < 0.2
    assert 0 < st.backlog_share <= 0.4


def test_a_smaller_rebuilt_group_sets_the_step_size():
    seen: list[PullContext] = []

    class Recording(Stratified):
        def choose(self, ctx, rng):
            seen.append(ctx)
            return super().choose(ctx, rng)

    pool = HSPool(PoolConfig(capacity=20, min_ready=1, jobs_in_flight_per_target=20), 2,
                  pull_policy=Recording(2), ranks=3, accum=2)
    pool.add_jobs(job(i, i % 2) for i in range(4))
    for _ in range(4):
        land(pool, pool.next_job(0))
    assert isinstance(pool.try_pull(0), PulledItem)
    pool.set_ranks(2)
    assert isinstance(pool.try_pull(0), PulledItem)
    assert [c.step_items for c in seen] == [6, 4]  # the policy sees the group's new size
    assert seen[0].round_slots == {0: 2, -1: 2, -2: 2} and seen[1].round_slots == {0: 1, -1: 2}
