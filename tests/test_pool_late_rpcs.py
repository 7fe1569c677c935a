"""Issue 12 item 7: a dead drafter incarnation's very late ack or payload_lost is fenced by generation."""
from __future__ import annotations

from app.config.schema import PoolConfig
from app.messages import ItemMeta, JobSpec, PulledItem
from app.pool.hs_pool import HSPool
from app.pool.pull_policy import RoundRobin


def _pool_with_one_item() -> tuple[HSPool, int]:
    pool = HSPool(PoolConfig(capacity=4, min_ready=1, jobs_in_flight_per_target=1), 1, pull_policy=RoundRobin(1))
    j = JobSpec(job_id=7, epoch=0, index=7, bucket=0, seq_indices=(7,), padded_tokens=64, est_bytes=100)
    pool.add_jobs([j])
    pool.finish_adding()
    issued = pool.next_job(0)
    assert pool.job_done(0, ItemMeta(issued.job_id, 0, 1, 50, 40, 100, 0, 0.01), payload="ref7")
    return pool, issued.job_id


def _reissue_to_new_incarnation(pool: HSPool, jid: int) -> int:
    """Drafter 0 (generation 0) leased the job and died; its leases were released and the job, recomputed,
    is now leased to drafter 0's next incarnation."""
    assert isinstance(pool.try_pull(0), PulledItem)
    pool.release(0)
    gen = pool.generation(0)
    assert gen == 1
    issued = pool.next_job(0)
    assert issued.job_id == jid
    assert pool.job_done(0, ItemMeta(jid, 0, 1, 50, 40, 100, 0, 0.01), payload="ref7b")
    got = pool.try_pull(0)
    assert isinstance(got, PulledItem) and got.meta.job_id == jid
    return gen


def test_a_late_payload_lost_from_a_dead_incarnation_leaves_the_new_lease_alone() -> None:
    pool, jid = _pool_with_one_item()
    gen = _reissue_to_new_incarnation(pool, jid)
    assert pool.payload_lost(0, jid, generation=gen - 1) is False  # the old incarnation's late call
    s = pool.stats()
    assert (s.leased, s.pending, s.buffered, s.lost_payloads) == (1, 0, 0, 0)
    assert pool.payload_lost(0, jid, generation=gen) is True  # the live incarnation's own call still works
    assert pool.stats().pending == 1


def test_a_late_ack_from_a_dead_incarnation_does_not_ack_the_new_lease() -> None:
    pool, jid = _pool_with_one_item()
    gen = _reissue_to_new_incarnation(pool, jid)
    assert pool.ack(0, [jid], generation=gen - 1) == 0
    s = pool.stats()
    assert (s.acked, s.leased, s.stale_acks) == (0, 1, 1)  # still leased: acked only once really trained
    assert pool.ack(0, [jid], generation=gen) == 1
    assert pool.stats().acked == 1
