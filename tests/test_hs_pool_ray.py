"""The pool actor on a local Ray cluster: producers, consumers, kills, Prometheus metrics."""
from __future__ import annotations

import re
import time
import urllib.request

import numpy as np
import pytest

from app import metric_names as mn
from app.config.schema import PoolConfig
from app.messages import EndOfStream, HiddenBatch, ItemMeta, JobSpec, PulledItem, StepRecord
from app.pool.hs_pool import Drained

pytestmark = pytest.mark.ray

PAYLOAD_FLOATS = 32 * 1024  # 128 KiB: above Ray's inline limit, so payloads live in plasma


class FakeTarget:
    """A producer: forward(job) -> (meta, payload) after `delay_s`, payload tagged with the job id."""

    def __init__(self, target_id: int, delay_s: float = 0.0) -> None:
        self.target_id = target_id
        self.delay_s = delay_s

    def forward(self, job: JobSpec):
        time.sleep(self.delay_s)
        hidden = np.full((1, PAYLOAD_FLOATS // 4, 4), job.job_id, dtype=np.float32)
        batch = HiddenBatch(
            job_id=job.job_id,
            hidden_BSD=hidden,
            hidden_dtype="float32",
            input_ids_BS=np.arange(8, dtype=np.int64)[None],
            loss_mask_BS=np.ones((1, 8), np.uint8),
            lengths_B=np.array([8]),
        )
        meta = ItemMeta(job.job_id, job.bucket, 1, 8, 8, hidden.nbytes, self.target_id, self.delay_s)
        return meta, batch


class FakeDrafter:
    """A consumer: pulls, reads the payload, acks every `accum` items, until end-of-stream. With
    `ack_on_pull` the acks ride on the next pull, as DrafterActor's do."""

    def run(self, pool, drafter_id: int, accum: int = 2, delay_s: float = 0.0, ack_on_pull: bool = False) -> dict:
        import ray

        seen, held, producers, acks = [], [], set(), []
        while True:
            got = ray.get(pool.pull.remote(drafter_id, 0, acks))
            acks = []
            if isinstance(got, EndOfStream):
                break
            if isinstance(got, PulledItem):
                batch = ray.get(got.payload_ref)
                assert int(batch.hidden_BSD[0, 0, 0]) == got.meta.job_id == batch.job_id
                producers.add(got.meta.target_id)
                held.append(got.meta.job_id)
                time.sleep(delay_s)
            if len(held) >= accum or isinstance(got, Drained):
                if ack_on_pull:
                    acks = list(held)
                else:
                    ray.get(pool.ack.remote(drafter_id, held))
                seen += held
                held = []
                if isinstance(got, Drained):
                    time.sleep(0.01)
        return {"seen": seen, "producers": sorted(producers)}


def jobs(n: int, buckets: int = 6) -> list[JobSpec]:
    return [JobSpec(i, 0, i, i % buckets, (i,), 8, est_bytes=PAYLOAD_FLOATS * 4 + 4096) for i in range(n)]


def start(ray, n_targets: int, delay_s: float, cfg: PoolConfig, run_name: str, max_concurrency: int = 128,
          pool_cls=None):
    import sys

    from actors.hs_pool import HSPoolActor

    # Workers cannot import this test module by name: ship the fake actor classes by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    pool = ray.remote(pool_cls or HSPoolActor).options(max_concurrency=max_concurrency).remote(cfg, 6, run_name)
    targets = [ray.remote(FakeTarget).remote(t, delay_s) for t in range(n_targets)]
    for t, h in enumerate(targets):
        ray.get(pool.add_target.remote(t, h))
    return pool, targets


def test_five_producers_three_consumers_move_every_job_once_despite_a_killed_producer(ray_cluster):
    ray = ray_cluster
    n = 120
    pool, targets = start(ray, 5, 0.02, PoolConfig(capacity=16, min_ready=4), "t-kill-producer")
    ray.get(pool.add_jobs.remote(jobs(n)))
    ray.get(pool.finish_adding.remote())
    drafters = [ray.remote(FakeDrafter).remote() for _ in range(3)]
    runs = [d.run.remote(pool, i, 2, 0.01, True) for i, d in enumerate(drafters)]
    deadline = time.time() + 60
    while ray.get(pool.stats.remote()).done_by_target.get(2, 0) < 3:
        assert time.time() < deadline
        time.sleep(0.05)
    ray.kill(targets[2])
    results = ray.get(runs, timeout=120)
    st = ray.get(pool.stats.remote())
    seen = sorted(j for r in results for j in r["seen"])
    assert seen == list(range(n))  # every job consumed exactly once
    assert ray.get(pool.ledger.remote()) == list(range(n))
    assert st.acked_twice == 0 and st.done
    assert st.eos_drafters == [0, 1, 2]
    assert 2 not in st.targets and any(f.target_id == 2 for f in st.target_failures)
    # items the killed producer made before dying were read by the consumers (the pool owns them)
    assert any(2 in r["producers"] for r in results)
    assert st.done_by_target[2] >= 3


def test_a_killed_consumer_returns_its_leases(ray_cluster):
    ray = ray_cluster
    n = 40
    pool, _ = start(ray, 3, 0.0, PoolConfig(capacity=12, min_ready=2), "t-kill-consumer")
    ray.get(pool.add_jobs.remote(jobs(n)))
    ray.get(pool.finish_adding.remote())
    victim = ray.remote(FakeDrafter).remote()
    victim_run = victim.run.remote(pool, 0, 1000, 0.0)  # never acks: holds every lease it pulls
    deadline = time.time() + 30
    while ray.get(pool.stats.remote()).leased_by_drafter.get(0, 0) < 5:
        assert time.time() < deadline
        time.sleep(0.02)
    ray.kill(victim)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(victim_run)
    released = ray.get(pool.release.remote(0))
    assert len(released) >= 5
    assert ray.get(pool.stats.remote()).leased_by_drafter.get(0, 0) == 0
    survivors = [ray.remote(FakeDrafter).remote() for _ in range(2)]
    results = ray.get([d.run.remote(pool, i + 1, 2) for i, d in enumerate(survivors)], timeout=60)
    assert sorted(j for r in results for j in r["seen"]) == list(range(n))
    assert ray.get(pool.ledger.remote()) == list(range(n))


def _counting_pool():
    """HSPoolActor that counts the pulls inside it: the test waits until all six hold their slots."""
    from actors.hs_pool import HSPoolActor

    class CountingPool(HSPoolActor):
        pulls_inside = 0

        async def pull(self, *args, **kwargs):
            self.pulls_inside += 1
            try:
                return await super().pull(*args, **kwargs)
            finally:
                self.pulls_inside -= 1

        async def waiting_pulls(self) -> int:
            return self.pulls_inside

    return CountingPool


def test_blocked_pulls_do_not_starve_the_calls_that_wake_them(ray_cluster):
    ray = ray_cluster
    # 3 drafters x 2 waiting pulls = 6 of 8 slots; add_jobs, acks and stats must still get in.
    pool, _ = start(ray, 2, 0.0, PoolConfig(capacity=8, min_ready=2), "t-slots", max_concurrency=8,
                    pool_cls=_counting_pool())
    waiting = [pool.pull.remote(d) for d in range(3) for _ in range(2)]
    # Not a sleep: the case arises only once all six pulls are inside the actor, each holding a slot.
    deadline = time.monotonic() + 60
    while ray.get(pool.waiting_pulls.remote(), timeout=10) < 6:
        assert time.monotonic() < deadline, "the six pulls never reached the pool"
        time.sleep(0.05)
    ready, _ = ray.wait(waiting, timeout=0)
    assert ready == []  # nothing to pull yet: they all wait
    assert ray.get(pool.waiting_pulls.remote(), timeout=10) == 6  # and still hold their six slots
    ray.get(pool.add_jobs.remote(jobs(12)), timeout=10)
    ray.get(pool.finish_adding.remote(), timeout=10)
    got = ray.get(waiting, timeout=20)
    assert all(isinstance(g, PulledItem) for g in got)
    by_drafter = {}
    for i, g in enumerate(got):
        by_drafter.setdefault(i // 2, []).append(g.meta.job_id)
    for d, ids in by_drafter.items():
        assert ray.get(pool.ack.remote(d, ids), timeout=10) == 2


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def _metric_values(text: str, name: str, run: str) -> dict[str, float]:
    """{bucket label: value} for samples of `name` (with or without Ray's `ray_` prefix)."""
    out = {}
    for line in text.splitlines():
        m = re.match(rf"^(?:ray_)?{name}\{{(.*)\}} ([0-9.eE+-]+)$", line)
        if m and f'run="{run}"' in m.group(1):
            b = re.search(r'bucket="(\d+)"', m.group(1))
            if b:
                out[b.group(1)] = float(m.group(2))
    return out


def test_prometheus_endpoint_shows_live_per_bucket_counts(ray_cluster):
    ray = ray_cluster
    run = "t-metrics"
    pool, _ = start(ray, 2, 0.0, PoolConfig(capacity=11, min_ready=2, metrics_every_s=0.5), run)
    ray.get(pool.add_jobs.remote([JobSpec(i, 0, i, b, (i,), 8, 1000) for i, b in enumerate([0, 0, 1, 3, 3, 3, 5] * 2)]))
    deadline = time.time() + 20
    while ray.get(pool.stats.remote()).buffered < 11:  # capacity stops production at 11 items
        assert time.time() < deadline
        time.sleep(0.05)
    q_hsb = ray.get(pool.stats.remote()).q_hsb
    for rank in range(2):
        rec = StepRecord(rank, 3, 0, 0.5, 1.0, 0.5, 100, 1.5, compute_s=0.3, data_wait_s=0.1)
        ray.get(pool.report_step.remote(rec))
    ray.get(pool.report_restart.remote("target"))  # the driver's reports reach the metrics via the snapshot
    ray.get(pool.report_tau.remote(3, 2.5))
    want = {str(b): float(n) for b, n in enumerate(q_hsb)}
    port = ray._private.worker.global_worker.node.metrics_export_port
    expected = (mn.POOL_BYTES, mn.POOL_CAPACITY_BYTES, mn.JOBS, mn.TRAIN_STEP, mn.TRAIN_LOSS, mn.TRAIN_TOKENS_TOTAL,
                mn.TARGET_TOKENS_TOTAL, mn.TARGET_BUSY_RATIO, mn.DRAFTER_DATA_WAIT_RATIO, mn.RESTARTS_TOTAL, mn.TAU)
    deadline, text, got, names = time.time() + 30, "", {}, []
    while time.time() < deadline:  # gauges land in different export rounds: wait for all of them
        text = _scrape(port)
        got = _metric_values(text, mn.POOL_ITEMS, run)
        names = sorted({line.split("{")[0] for line in text.splitlines() if "dflash_" in line and not line.startswith("#")})
        if got == want and all(any(n in (name, "ray_" + name) for n in names) for name in expected):
            break
        time.sleep(1)
    assert got == want, f"scraped {got}, pool says {want}"
    print("scraped dflash names:", names)
    for name in expected:
        assert any(n in (name, "ray_" + name) for n in names), (name, names)
    loss = [line for line in text.splitlines() if re.match(rf"^(?:ray_)?{mn.TRAIN_LOSS}\{{", line) and run in line]
    assert loss and float(loss[0].rsplit(" ", 1)[1]) == pytest.approx(0.5)  # the step's global loss
    for name, value in ((mn.TAU, 2.5), (mn.RESTARTS_TOTAL, 1.0)):
        rows = [line for line in text.splitlines() if re.match(rf"^(?:ray_)?{name}\{{", line) and run in line]
        assert rows and float(rows[0].rsplit(" ", 1)[1]) == pytest.approx(value), (name, rows)
