"""`python -m app.bench pool`: put+pull pairs per second, pool actor vs ray.util.queue.Queue, given the
same advantages.

A pair is one item made by a producer and taken by a consumer that reads its payload. Same work on
both sides, in the same run: P producer actors make N items (meta + a numpy payload of --kib KiB),
each producer with the same jobs in flight (4), and C consumers take them all and read every
payload, B items per call:
- pool: the HSPoolActor calls each producer's `forward` (num_returns=2, so the pool owns the refs);
  consumers `pull` one item per call at B=1 (the drafters' own call), and at B>1 up to B items per
  call (`BatchPullPool.pull_many`, the pool actor with a batched pull defined here, to match the
  queue's batch calls); their acks ride on the next call (as the drafters' do).
- queue: a feeder (the driver) calls the same `forward`s with the same jobs in flight, owns the refs
  as the pool does, and puts (meta, payload ref) pairs with `put_nowait_batch` (up to B at once);
  consumers `get_nowait_batch(B)`, falling back to a blocking `get` when fewer are queued, and read
  the payloads in one `ray.get`. Refs travel, not payloads, exactly as in the pool.
Both run at B=1 and B=4; the RESULT ratio is at B=4 (the bench's default batch).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from actors.hs_pool import HSPoolActor, pool_max_concurrency
from app.bench.common import own_cluster, print_result
from app.config.schema import PoolConfig
from app.messages import Drained, EndOfStream, HiddenBatch, ItemMeta, JobSpec, PulledItem
from app.pool.stream import RunShape

IN_FLIGHT = 4  # jobs per producer, both layouts
CAPACITY = 64  # items buffered + in flight (pool), queue size + feeder backlog (queue)


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
    """A zero-cost target: forward(job) -> (meta, payload), called with num_returns=2 by both layouts."""

    def __init__(self, target_id: int, floats: int) -> None:
        self.target_id, self.floats = target_id, floats

    def ready(self) -> bool:
        return True

    def forward(self, job: JobSpec) -> tuple[ItemMeta, HiddenBatch]:
        return make_item(job.job_id, job.bucket, self.floats, self.target_id)


class BatchPullPool(HSPoolActor):
    """The pool actor plus a batched pull, for B > 1 (the drafters pull one item per call)."""

    async def pull_many(self, drafter_id: int, n: int, generation: int = 0,
                        acks: list[int] | None = None) -> list[PulledItem | EndOfStream | Drained]:
        """Acks, then up to n pulls in one call: waits for the first, then takes what is ready now."""
        out = [await self.pull(drafter_id, generation, acks)]
        while len(out) < n and isinstance(out[-1], PulledItem):
            got = self._hs("").try_pull(drafter_id)  # the single run's pool
            if not isinstance(got, PulledItem):
                break
            out.append(got)
        return out


class BenchConsumer:
    """Takes items until end-of-stream and reads every payload; returns how many it took."""

    def ready(self) -> bool:
        return True

    def from_pool(self, pool, drafter_id: int, batch: int) -> int:
        import ray

        n, acks = 0, []
        while True:
            if batch == 1:  # the drafters' own call
                got = [ray.get(pool.pull.remote(drafter_id, 0, acks))]
            else:
                got = ray.get(pool.pull_many.remote(drafter_id, batch, 0, acks))
            items = [g for g in got if isinstance(g, PulledItem)]
            for it, payload in zip(items, ray.get([it.payload_ref for it in items])):
                assert payload.job_id == it.meta.job_id
            acks = [it.meta.job_id for it in items]  # ride on the next pull
            n += len(items)
            if any(isinstance(g, EndOfStream) for g in got):
                return n
            if any(isinstance(g, Drained) for g in got) and not items:
                time.sleep(0.002)  # others hold the last leases

    def from_queue(self, queue, batch: int) -> int:
        import ray
        from ray.util.queue import Empty

        n = 0
        while True:
            try:
                got = queue.get_nowait_batch(batch)
            except Empty:
                got = [queue.get()]
            eos = [g for g in got if isinstance(g, EndOfStream)]
            items = [g for g in got if not isinstance(g, EndOfStream)]
            for (meta, _), payload in zip(items, ray.get([ref for _, ref in items])):
                assert payload.job_id == meta.job_id
            n += len(items)
            if eos:
                if len(eos) > 1:  # other consumers' end markers: give them back
                    queue.put_nowait_batch(eos[1:])
                return n


def run_pool(ray, n: int, prods: list, cons: list, floats: int, buckets: int, batch: int) -> float:
    cfg = PoolConfig(capacity=CAPACITY, min_ready=1, jobs_in_flight_per_target=IN_FLIGHT, metrics_every_s=5.0)
    pool = ray.remote(BatchPullPool).options(
        max_concurrency=pool_max_concurrency(len(prods), len(cons))
    ).remote(cfg, buckets, "bench-pool", runs={"": RunShape(len(cons), batch)})
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


def run_queue(ray, n: int, prods: list, cons: list, floats: int, buckets: int, batch: int) -> float:
    from ray.util.queue import Full, Queue

    queue = Queue(maxsize=CAPACITY)
    queue.size()
    jobs = iter(JobSpec(i, 0, i, i % buckets, (i,), 4, 0) for i in range(n))
    t0 = time.perf_counter()
    runs = [c.from_queue.remote(queue, batch) for c in cons]
    inflight: dict = {}  # meta ref -> (producer, payload ref)

    def submit(p: int) -> None:
        job = next(jobs, None)
        if job is not None:
            meta_ref, payload_ref = prods[p].forward.options(num_returns=2).remote(job)
            inflight[meta_ref] = (p, payload_ref)

    for p in range(len(prods)):
        for _ in range(IN_FLIGHT):
            submit(p)
    ready: list = []  # made, not yet in the queue
    while inflight or ready:
        if inflight and len(ready) < CAPACITY - IN_FLIGHT * len(prods):
            done, _ = ray.wait(list(inflight), num_returns=1, timeout=0.01 if ready else None)
            done += ray.wait([r for r in inflight if r not in done], num_returns=len(inflight) - len(done),
                             timeout=0)[0] if len(inflight) > len(done) else []
            for ref, meta in zip(done, ray.get(done)):
                p, payload_ref = inflight.pop(ref)
                ready.append((meta, payload_ref))
                submit(p)
        while ready:
            chunk = ready[:batch]
            try:
                queue.put_nowait_batch(chunk)
            except Full:
                if not inflight:
                    time.sleep(0.001)
                break
            del ready[:len(chunk)]
    while True:
        try:
            queue.put_nowait_batch([EndOfStream() for _ in cons])
            break
        except Full:
            time.sleep(0.001)
    took = sum(ray.get(runs))
    dt = time.perf_counter() - t0
    assert took == n, took
    queue.shutdown()
    return n / dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.bench pool", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=1000)
    ap.add_argument("--producers", type=int, default=5)
    ap.add_argument("--consumers", type=int, default=3)
    ap.add_argument("--kib", type=int, default=256, help="payload size per item")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batches", default="1,4", help="items per consumer call; the last one gives RESULT's ratio")
    args = ap.parse_args(argv)
    ray = own_cluster(16)  # never another cluster on the machine (RAY_ADDRESS, ray start)
    floats = args.kib * 1024 // 4
    # The same producer and consumer actors serve both layouts (only the middle differs).
    prods = [ray.remote(BenchProducer).remote(t, floats) for t in range(args.producers)]
    cons = [ray.remote(BenchConsumer).remote() for _ in range(args.consumers)]
    ray.get([a.ready.remote() for a in prods + cons])
    shape = (args.items, prods, cons, floats, 6)
    print(f"pair = one item made by a producer and taken by a consumer that reads its {args.kib} KiB payload; "
          f"{args.items} items, {args.producers} producers x {IN_FLIGHT} in flight, {args.consumers} consumers, "
          f"best of {args.repeats}")
    best: dict[int, tuple[float, float]] = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        pool_rates, queue_rates = [], []
        for r in range(args.repeats):  # alternate so drift hits both alike
            pool_rates.append(run_pool(ray, *shape, batch=batch))
            queue_rates.append(run_queue(ray, *shape, batch=batch))
            print(f"batch {batch} round {r}: pool {pool_rates[-1]:.0f} pairs/s   queue {queue_rates[-1]:.0f} pairs/s")
        best[batch] = (max(pool_rates), max(queue_rates))
        print(f"batch {batch}: pool {best[batch][0]:.0f} pairs/s, ray.util.queue.Queue (refs, batch calls) "
              f"{best[batch][1]:.0f} pairs/s, ratio {best[batch][0] / best[batch][1]:.3f}")
    ray.shutdown()
    last = list(best)[-1]
    pool_best, queue_best = best[last]
    print_result({"pool_pairs_per_s": f"{pool_best:.1f}", "queue_pairs_per_s": f"{queue_best:.1f}",
                  "ratio": pool_best / queue_best, **{f"ratio_b{b}": p / q for b, (p, q) in best.items() if b != last}})
    return 0
