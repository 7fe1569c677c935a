"""The pool's compact job path (`HSPool.add_epoch`): the same jobs in the same order as a list of
JobSpecs, at about a byte of pool heap per queued job."""
from __future__ import annotations

import tracemalloc
from collections import deque
from dataclasses import replace

import numpy as np
import pytest

from app.config.schema import DataConfig, PoolConfig
from app.data.costs import sequence_rows, with_costs
from app.data.schedule import EpochJobs, epoch_jobs
from app.messages import ItemMeta, JobSpec, PulledItem, make_job_id
from app.pool.hs_pool import HSPool

BOUNDS = [64, 128, 256, 512]
BPT = 1000  # bytes per padded token


def schedule(epochs: int = 2) -> list[EpochJobs]:
    rng = np.random.default_rng(3)
    lengths = rng.integers(5, 512, 2500)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    loss_mask = (rng.random(int(offsets[-1])) < 0.6).astype(np.uint8)
    rows = sequence_rows(loss_mask, offsets, block_size=8, num_anchors=16)
    data = replace(DataConfig(), max_length=512, bucket_boundaries=BOUNDS, tokens_per_job=2048)
    return [epoch_jobs(lengths, data, e).with_costs(rows) for e in range(epochs)], rows, lengths, data


class OldQueue:
    """The queue as it was before the compact one: a deque of every pending JobSpec (the reference)."""

    def __init__(self, catalog) -> None:
        self.catalog, self._q = catalog, deque()

    def append(self, job: JobSpec) -> None:
        self.catalog.add_spec(job)  # the pool's rollback asks the catalog which jobs were added
        self._q.append(job)

    def push_front(self, job_ids) -> None:
        for job_id in reversed(list(job_ids)):
            self._q.appendleft(self.catalog.spec(job_id))

    def peek(self) -> JobSpec | None:
        return self._q[0] if self._q else None

    def pop(self) -> JobSpec:
        return self._q.popleft()

    def remove(self, job_ids: set[int]) -> None:
        self._q = deque(j for j in self._q if j.job_id not in job_ids)

    def __len__(self) -> int:
        return len(self._q)


def make_pool(old_queue: bool = False) -> HSPool:
    cfg = PoolConfig(capacity=100_000, capacity_bytes=1 << 40, min_ready=1, jobs_in_flight_per_target=100_000)
    return HSPool(cfg, len(BOUNDS), queue=OldQueue) if old_queue else HSPool(cfg, len(BOUNDS))


def drive(pool: HSPool, add) -> tuple[list[JobSpec], list[int], dict]:
    """One fixed story: restored ledger, a lost target, a ledger restored after adding, acks and a
    rollback, then everything issued. Returns every JobSpec issued, in order, the ledger and counts."""
    issued: list[JobSpec] = []

    def take(target: int, n: int) -> list[JobSpec]:
        got = [pool.next_job(target) for _ in range(n)]
        assert None not in got
        issued.extend(got)
        return got

    # Restored before adding: a whole byte of epoch 0 (skipped 8 at a time), scattered ids, epoch 1's first.
    pool.restore_ledger([make_job_id(0, i) for i in [*range(8, 16), 3, 40]] + [make_job_id(1, 0)])
    add(pool)
    pool.finish_adding()
    take(0, 6)
    take(1, 4)
    pool.target_lost(0)  # its 6 jobs go back to the front
    # Restored after adding: one job waiting at the front, two still ahead in the schedule.
    pool.restore_ledger([issued[1].job_id, make_job_id(0, 30), make_job_id(1, 5)])
    for j in issued[6:10]:
        assert pool.job_done(1, ItemMeta(j.job_id, j.bucket, 1, 10, 8, j.est_bytes, 1, 0.0), f"ref{j.job_id}")
    pulled = [pool.try_pull(0) for _ in range(4)]
    assert all(isinstance(p, PulledItem) for p in pulled)
    acked = [p.meta.job_id for p in pulled]
    assert pool.ack(0, acked) == 4
    # A checkpoint without the last two acks, one job restored after adding (it was queued: it goes
    # back) and one restored before (never queued by this pool: it stays acked).
    keep = [j for j in pool.ledger() if j not in {*acked[2:], make_job_id(0, 30), make_job_id(0, 40)}]
    assert pool.rollback(keep) == 3  # back to the front, in schedule order
    take(2, 3)
    pool.job_failed(2, issued[-2].job_id)  # one job back to the front
    while (j := pool.next_job(3)) is not None:
        issued.append(j)
    return issued, pool.ledger(), pool.stats()


def test_compact_epochs_issue_the_same_jobspecs_in_the_same_order_as_a_list():
    epochs, rows, lengths, data = schedule()
    specs = [j for e in epochs for j in with_costs(e.specs(est_bytes_per_token=BPT), rows)]

    def as_list(pool: HSPool) -> None:
        for i in range(0, len(specs), 100):  # chunks, as the supervisor once sent them
            pool.add_jobs(specs[i:i + 100])

    def compact(pool: HSPool) -> None:
        for e in epochs:
            pool.add_epoch(e, BPT)

    old, new = drive(make_pool(old_queue=True), as_list), drive(make_pool(), compact)
    assert drive(make_pool(), as_list)[0] == old[0]  # JobSpecs added one by one, through the new queue
    assert new[0] == old[0]  # every field of every JobSpec, in the same order
    assert new[1] == old[1]
    for field in ("pending", "in_flight", "buffered", "leased", "acked", "total_jobs", "data_shares", "q_hsb"):
        assert getattr(new[2], field) == getattr(old[2], field), field
    # Sanity of the story itself: nothing skipped was issued, everything else exactly once or re-issued.
    skipped = {make_job_id(0, i) for i in [*range(8, 16), 3, 40]} | {make_job_id(1, 0), make_job_id(1, 5)}
    ids = [j.job_id for j in new[0]]
    assert not skipped & set(ids)
    assert set(ids) | skipped | {new[0][1].job_id} == {j.job_id for j in specs}
    assert all(j.est_bytes == epochs[j.epoch].payload_bytes(j.index, BPT) for j in new[0])
    assert any(j.cost for j in new[0])


def test_add_epoch_names_the_fix_for_bad_jobs():
    epochs = schedule()[0]
    pool = HSPool(PoolConfig(capacity_bytes=10**6), len(BOUNDS))
    with pytest.raises(ValueError, match="capacity_bytes"):
        pool.add_epoch(epochs[0], BPT)  # 2048 tokens x 1000 bytes > 1 MB
    pool = HSPool(PoolConfig(), 2)
    with pytest.raises(ValueError, match="bucket [23]"):
        pool.add_epoch(epochs[0], BPT)
    pool = HSPool(PoolConfig(), len(BOUNDS))
    pool.add_epoch(epochs[0], BPT)
    with pytest.raises(ValueError, match="added twice"):
        pool.add_epoch(epochs[0], BPT)
    with pytest.raises(ValueError, match="added twice"):
        pool.add_jobs([epochs[0].spec(4)])


def test_a_queued_job_costs_about_a_byte_of_pool_heap():
    rng = np.random.default_rng(0)
    n = 50_000  # per epoch; 100k jobs in all

    def synthetic(epoch: int) -> EpochJobs:  # 20 sequences per job; built outside the measurement
        return EpochJobs(epoch=epoch, bucket=rng.integers(0, len(BOUNDS), n).astype(np.uint8),
                         padded=np.full(n, 2048, np.int32), starts=np.arange(n + 1, dtype=np.int64) * 20,
                         seq_ids=rng.integers(0, 10**6, 20 * n).astype(np.int32),
                         cost=rng.integers(0, 4096, n).astype(np.int64))

    epochs = [synthetic(0), synthetic(1)]
    pool = make_pool()
    pool.restore_ledger([make_job_id(0, i) for i in range(0, n, 97)])  # a resumed run: some acked
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        queued = sum(pool.add_epoch(e, BPT) for e in epochs)
        for _ in range(10):
            pool.next_job(0)
        per_job = (tracemalloc.get_traced_memory()[0] - before) / queued
    finally:
        tracemalloc.stop()
    assert queued == 2 * n - len(range(0, n, 97))
    assert pool.stats().pending == queued - 10
    assert per_job < 4, per_job  # a state byte and two skip bits; a JobSpec each was ~1.4 KB
