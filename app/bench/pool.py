"""`python -m app.bench pool`: put+pull pairs per second, pool actor vs ray.util.queue.Queue.

A pair is one item put in by a producer and taken out by a consumer that reads its payload.
Both sides do the same work in the same run: P producer actors make N items (meta + a numpy
payload of --kib KiB), C consumer actors take them all and read every payload.
- pool: the HSPoolActor calls each producer's `forward` (num_returns=2, so the pool owns the
  refs); consumers `pull_many` up to 4 items and ack them in one call (one ack per grad-accum
  window, as the drafters do).
- queue: producers `put((meta, payload))` into one `ray.util.queue.Queue` (its default
  put/get, the layout the pool replaces); consumers `get` and read the payload.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from app.config.schema import PoolConfig
from app.messages import EndOfStream, HiddenBatch, ItemMeta, JobSpec, PulledItem


def make_item(job_id: int, bucket: int, floats: int, target_id: int) -> tuple[ItemMeta, HiddenBatch]:
    hidden = np.full((1, floats // 4, 4), job_id, dtype=np.float32)
    batch = HiddenBatch(
        job_id=job_id,
        hidden_BSD=hidden,
        hidden_dtype="float32",
        input_ids_BS=np.zeros((1, 4), np.int64),
        loss_mask_BS=np.ones((1, 4), np.uint8),
        lengths_B=np.array([4]),
    )
    return ItemMeta(job_id, bucket, 1, 4, 4, hidden.nbytes, target_id, 0.0), batch


class BenchProducer:
    """A zero-cost target: forward(job) for the pool, produce(queue, ids) for the queue."""

    def __init__(self, target_id: int, floats: int) -> None:
        self.target_id, self.floats = target_id, floats

    def ready(self) -> bool:
        return True

    def forward(self, job: JobSpec) -> tuple[ItemMeta, HiddenBatch]:
        return make_item(job.job_id, job.bucket, self.floats, self.target_id)

    def produce(self, queue, job_ids: list[int], buckets: int) -> int:
        for jid in job_ids:
            queue.put(make_item(jid, jid % buckets, self.floats, self.target_id))
        return len(job_ids)


class BenchConsumer:
    """Takes items until end-of-stream and reads every payload; returns how many it took."""

    def ready(self) -> bool:
        return True

    def from_pool(self, pool, drafter_id: int, batch: int) -> int:
        import ray

        n = 0
        while True:
            got = ray.get(pool.pull_many.remote(drafter_id, batch))
            items = [g for g in got if isinstance(g, PulledItem)]
            for it, payload in zip(items, ray.get([it.payload_ref for it in items])):
                assert payload.job_id == it.meta.job_id
            if items:
                pool.ack.remote(drafter_id, [it.meta.job_id for it in items])
                n += len(items)
            if any(isinstance(g, EndOfStream) for g in got):
                return n
            if not items:
                time.sleep(0.002)  # Drained: others hold the last leases

    def from_queue(self, queue) -> int:
        n = 0
        while True:
            got = queue.get()
            if isinstance(got, EndOfStream):
                return n
            meta, payload = got
            assert payload.job_id == meta.job_id
            n += 1


def run_pool(ray, n: int, prods: list, cons: list, floats: int, buckets: int, batch: int = 4) -> float:
    from actors.hs_pool import HSPoolActor, pool_max_concurrency

    cfg = PoolConfig(capacity=64, min_ready=1, jobs_in_flight_per_target=4, metrics_every_s=5.0)
    pool = ray.remote(HSPoolActor).options(
        max_concurrency=pool_max_concurrency(len(prods), len(cons))
    ).remote(cfg, buckets, "bench-pool")
    ray.get(pool.ledger.remote())
    jobs = [JobSpec(i, 0, i, i % buckets, (i,), 4, floats * 4 + 4096) for i in range(n)]
    t0 = time.perf_counter()
    runs = [c.from_pool.remote(pool, d, batch) for d, c in enumerate(cons)]
    ray.get(pool.add_jobs.remote(jobs))
    ray.get(pool.finish_adding.remote())
    for t, p in enumerate(prods):
        ray.get(pool.add_target.remote(t, p))
    took = sum(ray.get(runs))
    dt = time.perf_counter() - t0
    assert took == n and ray.get(pool.ledger.remote()) == list(range(n))
    ray.kill(pool)
    return n / dt


def run_queue(ray, n: int, prods: list, cons: list, floats: int, buckets: int) -> float:
    from ray.util.queue import Queue

    queue = Queue(maxsize=64)
    queue.size()
    t0 = time.perf_counter()
    runs = [c.from_queue.remote(queue) for c in cons]
    ids = list(range(n))
    ray.get([p.produce.remote(queue, ids[t :: len(prods)], buckets) for t, p in enumerate(prods)])
    for _ in cons:
        queue.put(EndOfStream())
    took = sum(ray.get(runs))
    dt = time.perf_counter() - t0
    assert took == n
    queue.shutdown()
    return n / dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.bench pool", description=__doc__)
    ap.add_argument("--items", type=int, default=1000)
    ap.add_argument("--producers", type=int, default=5)
    ap.add_argument("--consumers", type=int, default=3)
    ap.add_argument("--kib", type=int, default=256, help="payload size per item")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--pull-batch", type=int, default=4, help="items per pull_many call (acks: one per call)")
    args = ap.parse_args(argv)
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=16, include_dashboard=False, configure_logging=False, log_to_driver=False)
    floats = args.kib * 1024 // 4
    # The same producer and consumer actors serve both layouts (only the middle differs).
    prods = [ray.remote(BenchProducer).remote(t, floats) for t in range(args.producers)]
    cons = [ray.remote(BenchConsumer).remote() for _ in range(args.consumers)]
    ray.get([a.ready.remote() for a in prods + cons])
    shape = (args.items, prods, cons, floats, 6)
    print(f"pair = one item put by a producer and pulled by a consumer that reads its {args.kib} KiB payload")
    print(f"{args.items} items, {args.producers} producers, {args.consumers} consumers, {args.repeats} rounds")
    pool_rates, queue_rates = [], []
    for r in range(args.repeats):  # alternate so drift hits both alike
        pool_rates.append(run_pool(ray, *shape, batch=args.pull_batch))
        queue_rates.append(run_queue(ray, *shape))
        print(f"round {r}: pool {pool_rates[-1]:.0f} pairs/s   queue {queue_rates[-1]:.0f} pairs/s")
    pool_best, queue_best = max(pool_rates), max(queue_rates)
    ratio = pool_best / queue_best
    print(f"best of {args.repeats}: pool {pool_best:.0f} pairs/s, ray.util.queue.Queue {queue_best:.0f} pairs/s")
    print(f"RESULT pool_pairs_per_s={pool_best:.1f} queue_pairs_per_s={queue_best:.1f} ratio={ratio:.3f}")
    ray.shutdown()
    return 0
