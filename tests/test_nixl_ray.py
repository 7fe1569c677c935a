"""pool.transport=nixl on a local Ray cluster (CPU: behaviour, not speed). The real TargetActor.forward (a
cheap trunk in place of the model), the real HSPoolActor holding the refs, the drafter's own `fetch_next`
with a `NixlReceiver` and the stager's host copy: every payload read lands intact, a payload stays in its
target's memory until the ack and is freed after it, and a target's death re-queues its unconsumed
payloads so every job is consumed exactly once."""
from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

from actors.target import BusyClock, TargetActor
from app.config.checks import nixl_installed
from app.config.run_sections import FaultsConfig
from app.config.schema import PoolConfig
from app.messages import EndOfStream, JobSpec
from app.pool.hs_pool import Drained
from app.payload.transport import HeldPayloads, warm_up_nixl
from app.replay.target_side import TargetCounts

pytestmark = [pytest.mark.ray, pytest.mark.slow,
              pytest.mark.skipif(not nixl_installed(), reason="pool.transport=nixl needs pip install 'dflash-ray[nixl]'")]

TOKENS, WIDTH = 64, 2048  # 256 KiB of bf16 features per job: far above Ray's inline limit


class IdsTrunk:
    """Features that name their tokens: every column of a token's row holds its id (exact in bf16)."""

    model = None

    def features(self, ids_BS, attn_BS):
        import torch

        return ids_BS.to(torch.bfloat16)[..., None].expand(*ids_BS.shape, WIDTH).contiguous()


class Dataset:
    def sequence(self, i: int):
        return np.arange(TOKENS, dtype=np.int64) % 200 + i % 50, np.ones(TOKENS, np.uint8)


class CheapTarget(TargetActor):
    """TargetActor with its model replaced by IdsTrunk: `forward` and `payloads_held` are the real ones."""

    def __init__(self, target_id: int, run_dir: str, transport: str = "nixl") -> None:
        import torch

        self.target_id, self.layer_ids, self.dataset = target_id, [0], Dataset()
        self.feature_dtype, self.faults, self.run_dir, self.sticky = "bfloat16", FaultsConfig(), run_dir, False
        self.device, self.trunk = torch.device("cpu"), IdsTrunk()
        self.compute_lock, self.busy, self.jobs_done = threading.Lock(), BusyClock(), 0
        self.transport, self.held = transport, HeldPayloads()
        self.counts, self.replay = TargetCounts(), None  # no replay store: every job is a forward
        if transport == "nixl":
            warm_up_nixl()


class Reader:
    """A drafter rank's prefetch work: `fetch_next` + `NixlReceiver` + the stager's host copy, checked."""

    def __init__(self) -> None:
        import torch

        from app.payload.nixl_receive import NixlReceiver
        from app.payload.staging import PayloadStager

        self.receiver = NixlReceiver()
        self.stager = PayloadStager(torch.device("cpu"), torch.float32, side_stream=object())  # the host half
        self.acks: list[int] = []
        self.generation: int | None = None
        self.seen: dict[int, int] = {}  # job id -> the target that made the payload read

    def take(self, pool):
        """Pull one item (the last one's ack riding along) and read it; its job id, or the end marker."""
        import torch

        from actors.drafter_ops import fetch_next

        checked = {}

        def stage(hb):
            host = self.stager.stage_host(hb).view(torch.bfloat16).float().numpy()
            ids = np.asarray(hb.input_ids_BS)
            checked["ok"] = bool((host == ids[..., None]).all()) and hb.hidden_BSD.shape[-1] == WIDTH
            return hb.job_id

        import ray

        if self.generation is None:
            self.generation = ray.get(pool.generation.remote(0))
        pulled, job_id = fetch_next(pool, 0, self.generation, self.acks, stage, receive=self.receiver.receive)
        self.acks = []
        if isinstance(pulled, (EndOfStream, Drained)):
            return type(pulled).__name__
        assert checked["ok"] and job_id == pulled.meta.job_id, f"job {pulled.meta.job_id} arrived damaged"
        assert pulled.meta.job_id not in self.seen, f"job {pulled.meta.job_id} read twice"
        self.seen[pulled.meta.job_id] = pulled.meta.target_id
        return job_id

    def ack_later(self, job_id: int) -> None:
        self.acks.append(job_id)

    def drain(self, pool) -> dict[int, int]:
        """Read and ack everything to the end of the stream (acks ride on the next pull, as a drafter's)."""
        while True:
            got = self.take(pool)
            if got == "EndOfStream":
                return self.seen
            if got == "Drained":  # our last ack went with that pull; others' leases are outstanding
                time.sleep(0.01)
            else:
                self.acks = [got]

    def receiver_stats(self) -> tuple[int, int, int]:
        return self.receiver.jobs, self.receiver.copied, self.receiver.buffer_bytes()


def jobs(n: int) -> list[JobSpec]:
    return [JobSpec(i, 0, i, 0, (i,), TOKENS, est_bytes=TOKENS * WIDTH * 2 + 4096) for i in range(n)]


def start(ray, tmp_path, n_targets: int, capacity: int, name: str):
    from actors.hs_pool import HSPoolActor

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this module by name
    cfg = PoolConfig(capacity=capacity, min_ready=1, jobs_in_flight_per_target=1, capacity_bytes=64 * 2**20,
                     metrics_every_s=60.0, transport="nixl")
    pool = ray.remote(HSPoolActor).options(max_concurrency=64).remote(cfg, 1, name)
    targets = [ray.remote(CheapTarget).remote(t, str(tmp_path)) for t in range(n_targets)]
    for t, h in enumerate(targets):
        ray.get(pool.add_target.remote(t, h))
    return pool, targets, ray.remote(Reader).remote()


def wait_for(pred, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (got := pred()):
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)
    return got


def test_a_payload_stays_in_its_target_until_the_ack_then_its_memory_goes_back(ray_cluster, tmp_path):
    ray = ray_cluster
    n = 5
    pool, (target,), reader = start(ray, tmp_path, 1, 2, "t-nixl-free")
    ray.get(pool.add_jobs.remote(jobs(n)))
    ray.get(pool.finish_adding.remote())
    first = ray.get(reader.take.remote(pool), timeout=60)
    held, nbytes = ray.get(target.payloads_held.remote())
    assert first in held  # read, leased, not acked: the pool's ref keeps it in the target
    assert nbytes >= len(held) * TOKENS * WIDTH * 2
    ray.get(reader.ack_later.remote(first))
    second = ray.get(reader.take.remote(pool), timeout=30)  # the ack rides on this pull
    wait_for(lambda: first not in ray.get(target.payloads_held.remote())[0], "the acked payload to be freed")
    assert second in ray.get(target.payloads_held.remote())[0]
    ray.get(reader.ack_later.remote(second))
    seen = ray.get(reader.drain.remote(pool), timeout=60)
    assert sorted(seen) == list(range(n))  # every job read once, intact (checked in the reader)
    assert ray.get(pool.ledger.remote()) == list(range(n))
    assert wait_for(lambda: ray.get(target.payloads_held.remote()) == ([], 0), "the target's memory back")
    jobs_read, copied, buffer_bytes = ray.get(reader.receiver_stats.remote())
    assert jobs_read == n and copied == 0  # every payload landed in the reader's own registered buffers
    assert 0 < buffer_bytes < 4 * TOKENS * WIDTH * 2  # two buffers, reused: not one per job
    for actor in (pool, target, reader):
        ray.kill(actor)


def test_a_dead_targets_unconsumed_payloads_are_made_again_and_every_job_is_read_once(ray_cluster, tmp_path):
    ray = ray_cluster
    n = 10
    pool, targets, reader = start(ray, tmp_path, 2, 4, "t-nixl-death")
    ray.get(pool.add_jobs.remote(jobs(n)))
    ray.get(pool.finish_adding.remote())
    # Nothing is read yet: whatever target 1 made is buffered in the pool and held in target 1 only.
    lost_with_it = wait_for(lambda: ray.get(targets[1].payloads_held.remote())[0], "target 1 to hold a payload")
    ray.kill(targets[1])
    seen = ray.get(reader.drain.remote(pool), timeout=90)
    st = ray.get(pool.stats.remote())
    assert sorted(seen) == list(range(n))  # exactly once each, none lost, none twice
    assert ray.get(pool.ledger.remote()) == list(range(n)) and st.acked_twice == 0
    assert st.lost_payloads >= 1  # read attempts that found the owner gone, re-queued
    assert all(seen[j] == 0 for j in lost_with_it)  # made again by the live target
    for actor in (pool, targets[0], reader):
        ray.kill(actor)
