"""The pool actor's control state without Ray (app/pool/stream.py PoolControl): targets and pauses, failures,
eval offers, the stop flag, step records, reports; and the pull wait, measured once by the pool."""
from __future__ import annotations

import asyncio

from app.config.schema import PoolConfig
from app.messages import PulledItem, StepRecord, TargetFailure
from app.pool.stream import PoolControl
from app.pool.hs_pool import HSPool
from tests.pool_helpers import job, meta_for


def control(n_jobs: int = 8, per_target: int = 2, **kw) -> PoolControl:
    pool = HSPool(PoolConfig(capacity=20, min_ready=1, jobs_in_flight_per_target=per_target), 2, **kw)
    pool.add_jobs(job(i, i % 2) for i in range(n_jobs))
    return PoolControl(pool)


def drain_jobs(c: PoolControl, tid: int, handle: object) -> list[int]:
    out = []
    while (j := c.next_job(tid, handle)) is not None:
        out.append(j.job_id)
    return out


def record(rank: int, step: int, job_ids: tuple[int, ...] = ()) -> StepRecord:
    return StepRecord(rank, step, 0, 0.5, 1.0, 0.5, 100, 1.5, job_ids=job_ids)


def test_a_paused_target_gets_no_jobs_until_resumed_and_others_keep_producing():
    c = control()
    a, b = object(), object()
    c.add_target(0, a)
    c.add_target(1, b)
    c.pause(0)
    assert drain_jobs(c, 0, a) == []
    assert drain_jobs(c, 1, b) == [0, 1]  # its two slots
    c.resume(0)
    assert drain_jobs(c, 0, a) == [2, 3]
    assert c.stats().paused_targets == [] and c.stats().targets == [0, 1]


def test_only_the_registered_incarnation_gets_jobs_or_counts_its_failures():
    c = control()
    old, new = object(), object()
    c.add_target(0, old)
    assert drain_jobs(c, 0, old) == [0, 1]
    c.add_target(0, new)  # restarted: the old incarnation's jobs go back to the front
    assert c.pool.stats().pending == 8 and drain_jobs(c, 0, old) == []
    assert drain_jobs(c, 0, new) == [0, 1]
    c.target_died(0, old, 0, "RayActorError", "the old one died late")  # ignored: replaced already
    assert c.failures == [] and c.pool.stats().in_flight == 2
    c.target_died(0, new, 1, "RayActorError", "\n  The actor died unexpectedly\nmore detail\n")
    st = c.stats()
    assert st.target_failures == [TargetFailure(0, 1, "RayActorError: The actor died unexpectedly")]
    assert st.targets == [] and st.in_flight == 0 and st.pending == 8  # both back in the queue
    assert drain_jobs(c, 0, new) == []  # removed: no more jobs


def test_a_job_raising_on_a_live_target_is_requeued_then_quarantined_with_its_last_line():
    """Quarantined once it raised on two different targets (issue 22 item 1), neither restarted."""
    c = control(n_jobs=1, per_target=1)
    handles = [object(), object()]
    c.add_target(0, handles[0])
    traceback = "Traceback (most recent call last):\n  File x\nIndexError: index out of range\n"
    for tid in (0, 1):
        assert drain_jobs(c, tid, handles[tid]) == [0]
        c.target_raised(tid, handles[tid], 0, "RayTaskError", traceback)
        if tid == 0:
            c.add_target(1, handles[1])
            assert drain_jobs(c, 0, handles[0]) == []  # the other target re-tries it first
    st = c.stats()
    assert st.quarantined == {0: "IndexError: index out of range"} and st.targets == [0, 1]
    assert st.target_failures == [] and st.pending == 0 and st.in_flight == 0


def test_the_newest_eval_offer_wins_and_replaced_offers_are_counted():
    c = control()
    assert c.take_eval() is None
    c.offer_eval(20, ["w20"])
    c.offer_eval(40, ["w40"])  # training outran evaluation: 20 is superseded
    assert c.take_eval() == (40, ["w40"]) and c.take_eval() is None
    c.offer_eval(60, ["w60"])  # the previous one was taken: nothing superseded
    assert c.stats().eval_offers_superseded == 1 and c.take_eval() == (60, ["w60"])


def test_step_records_reach_the_driver_and_the_exporter_once_each_and_feed_the_step_mix():
    c = control()
    for step in range(4):
        for rank in range(2):
            c.report_step(record(rank, step, (2 * step + rank,)))
    drained = c.drain_step_records()
    assert [(r.step, r.rank) for r in drained] == [(s, r) for s in range(4) for r in range(2)]
    assert c.drain_step_records() == []
    assert c.take_unexported() == drained and c.take_unexported() == []
    assert c.stats().steps_measured == 2  # a step counts once a report two steps later arrived


def test_unexported_records_are_bounded():
    c = PoolControl(HSPool(PoolConfig(), 2), unexported=3)
    for step in range(5):
        c.report_step(record(0, step))
    assert [r.step for r in c.take_unexported()] == [2, 3, 4]
    assert len(c.drain_step_records()) == 5  # the driver's relay is not cut


def test_stop_tau_and_restarts_are_kept_for_the_snapshot():
    c = control()
    assert not c.stop_requested and c.stats().tau is None and c.stats().restarts == {}
    c.request_stop()
    c.report_tau(2.5)
    for kind in ("target", "target", "drafter_group"):
        c.report_restart(kind)
    st = c.stats()
    assert c.stop_requested and st.tau == 2.5 and st.restarts == {"target": 2, "drafter_group": 1}


def test_the_pull_wait_is_measured_once_by_the_pool_on_its_clock():
    now = [100.0]
    pool = HSPool(PoolConfig(capacity=4, min_ready=1), 1, clock=lambda: now[0])
    pool.add_jobs([job(0)])

    async def main() -> None:
        waiting = asyncio.ensure_future(pool.pull(0))
        await asyncio.sleep(0)  # the pull waits: nothing is buffered
        now[0] += 2.5
        pool.job_done(0, meta_for(pool.next_job(0), 0), None)
        assert isinstance(await waiting, PulledItem)

    asyncio.run(main())
    waits = pool.stats().pull_waits
    assert (waits.count, waits.sum_s, waits.p50_s) == (1, 2.5, 2.5)
    assert pool.drain_pull_waits() == [2.5] and pool.drain_pull_waits() == []  # the histogram's batch
    assert pool.stats().pull_waits.count == 1  # draining leaves the all-time stats alone


def test_a_target_two_runs_of_a_sweep_evaluate_on_trains_again_once_both_resumed_it():
    c = control()
    a = object()
    c.add_target(0, a)
    c.pause(0, "depth1")
    c.pause(0, "depth2")
    c.pause(0, "depth2")  # a retried call changes nothing
    c.resume(0, "depth1")
    assert drain_jobs(c, 0, a) == [] and c.stats().paused_targets == [0]  # depth2 still evaluates on it
    c.resume(0, "depth2")
    assert drain_jobs(c, 0, a) == [0, 1] and c.stats().paused_targets == []
