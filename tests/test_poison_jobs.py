"""Issue 12 item 1: a job whose forward fails twice (on any targets) is quarantined; the run goes on."""
from __future__ import annotations

from app.config.schema import PoolConfig
from app.messages import EndOfStream, ItemMeta, JobSpec, PulledItem
from app.pool.hs_pool import HSPool
from app.pool.pull_policy import RoundRobin


def _job(i: int) -> JobSpec:
    return JobSpec(job_id=i, epoch=0, index=i, bucket=0, seq_indices=(i,), padded_tokens=64, est_bytes=100)


def test_a_job_failing_twice_is_quarantined_and_the_rest_completes() -> None:
    pool = HSPool(PoolConfig(capacity=8, min_ready=1, jobs_in_flight_per_target=1), 1, pull_policy=RoundRobin(1))
    pool.add_jobs([_job(i) for i in range(3)])
    pool.finish_adding()
    failures = 0
    trained: list[int] = []
    while not pool.done:
        for target in (0, 1):  # the poison job fails on each target in turn
            job = pool.next_job(target)
            if job is None:
                continue
            if job.job_id == 1:
                assert pool.job_raised(target, 1, "IndexError: index out of range in self")
                failures += 1
                continue
            assert pool.job_done(target, ItemMeta(job.job_id, 0, 1, 50, 40, 100, target, 0.01), f"ref{job.job_id}")
        got = pool.try_pull(0)
        if isinstance(got, PulledItem):
            trained.append(got.meta.job_id)
            pool.ack(0, [got.meta.job_id])
        assert failures <= 2, "the poison job was issued a third time"
    assert isinstance(pool.try_pull(0), EndOfStream)
    s = pool.stats()
    assert failures == 2 and sorted(trained) == [0, 2]
    assert s.quarantined == {1: "IndexError: index out of range in self"}
    assert (s.acked, s.pending, s.in_flight, s.buffered, s.leased) == (2, 0, 0, 0, 0)
    assert s.pool_bytes == 0  # the quarantined job's reservation was given back


def test_one_failure_requeues_at_the_front() -> None:
    pool = HSPool(PoolConfig(capacity=8, min_ready=1, jobs_in_flight_per_target=1), 1, pull_policy=RoundRobin(1))
    pool.add_jobs([_job(i) for i in range(2)])
    assert pool.next_job(0).job_id == 0
    assert pool.job_raised(0, 0, "CUDA out of memory")
    assert pool.next_job(1).job_id == 0 and pool.stats().quarantined == {}
    assert pool.job_failed(1, 0)  # a target death is not counted against the job
    # Job 0 waits for a target that did not fail it yet (issue 22 item 1): target 0 gets the next job
    assert pool.next_job(0).job_id == 1 and pool.next_job(1).job_id == 0 and pool.stats().quarantined == {}


def test_a_payload_larger_than_the_byte_cap_does_not_wedge_its_bucket() -> None:
    """Issue 12 item 3 (the wedge): after a payload above capacity_bytes landed, its bucket's reservation
    stayed above the cap and no job of that bucket was ever issued again."""
    pool = HSPool(PoolConfig(capacity=8, capacity_bytes=1000, min_ready=1, jobs_in_flight_per_target=1), 1,
                  pull_policy=RoundRobin(1))
    pool.add_jobs([_job(i) for i in range(3)])
    pool.finish_adding()
    trained = []
    for _ in range(10):
        job = pool.next_job(0)
        if job is not None:
            assert pool.job_done(0, ItemMeta(job.job_id, 0, 1, 50, 40, 2500, 0, 0.01), f"ref{job.job_id}")
        got = pool.try_pull(0)
        if isinstance(got, PulledItem):
            trained.append(got.meta.job_id)
            pool.ack(0, [got.meta.job_id])
    assert sorted(trained) == [0, 1, 2] and pool.done
