"""The sleeping actors of `python -m app.bench sched` (app/bench/feeding/sched.py): targets that sleep a job's
cost and hand back a tiny payload, drafter ranks that run the drafter's own step protocol
(`app/training/loop.py`, as actors/drafter.py drives it) with a sleep of the item's cost for compute, and
the barrier actor that stands in for the step's collectives.
"""
from __future__ import annotations

import time

import numpy as np

from app.messages import EndOfStream, HiddenBatch, ItemMeta, JobSpec, PulledItem
from app.training.effects import (AwaitPull, Compute, Fetched, Gather, LoopConfig, PullAnswered, Reduce, SendAcks,
                                  Sleep, StartPull, StepTotals, sum_votes)
from app.training.loop import QuietHooks, RankLoop, drive

NUM_TARGETS, NUM_DRAFTERS, ACCUM = 5, 3, 4


def _payload(job: JobSpec, target_id: int, cost: float) -> tuple[ItemMeta, HiddenBatch]:
    hb = HiddenBatch(job.job_id, np.zeros((1, 4, 4), np.float32), "float32",
                     np.zeros((1, 4), np.int64), np.ones((1, 4), np.uint8), np.array([4]))
    return ItemMeta(job.job_id, job.bucket, 1, 4, 4, 64, target_id, cost), hb


class SleepTarget:
    """Sleeps its cost per job; serves the pool (forward) or its queue (produce); logs when each lands."""

    def __init__(self, target_id: int, target_cost: list[float], seed: int) -> None:
        import random

        self.target_id, self.cost, self.rng = target_id, target_cost, random.Random(seed)
        self.log: list[tuple[int, int, float]] = []  # (job id, bucket, time done)

    def ready(self) -> bool:
        return True

    def forward(self, job: JobSpec):
        cost = self.cost[job.bucket] * (0.85 + 0.3 * self.rng.random())
        time.sleep(cost)
        self.log.append((job.job_id, job.bucket, time.time()))
        return _payload(job, self.target_id, cost)

    def produce(self, queue, jobs: list[JobSpec]) -> int:
        for job in jobs:
            got = self.forward(job)
            queue.put(got)
            self.log[-1] = (job.job_id, job.bucket, time.time())  # in the buffer once the put returns
        return len(jobs)

    def take_log(self) -> list[tuple[int, int, float]]:
        out, self.log = self.log, []
        return out


class Barrier:
    """The step's collectives (the all-reduce, the all-gather): every rank's value, once all arrived."""

    def __init__(self, ranks: int) -> None:
        self.ranks, self.rounds = ranks, {}

    async def arrive(self, key: tuple[str, int], rank: int, value) -> list:
        import asyncio

        st = self.rounds.setdefault(key, {"values": [None] * self.ranks, "n": 0, "ev": asyncio.Event()})
        st["values"][rank] = value
        st["n"] += 1
        if st["n"] == self.ranks:
            st["ev"].set()
        await st["ev"].wait()
        return st["values"]


class _SleepOps(QuietHooks):
    """The loop's operations of one sleeping rank: Ray pulls (or a queue), sleeps, the barrier actor."""

    def __init__(self, source, is_pool: bool, rank: int, cost: list[float], barrier) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.source, self.is_pool, self.rank, self.cost, self.barrier = source, is_pool, rank, cost, barrier
        self.ex, self.pending = ThreadPoolExecutor(1), None
        self.reduces, self.optimizer_steps = 0, 0
        self.items: list = []  # (step, job id, bucket, time received)
        self.waits: list = []  # (start, end) of each wait for a pull

    def _fetch(self, acks: tuple[int, ...]):
        import ray

        if not self.is_pool:
            got = self.source.get()
            return (got if isinstance(got, EndOfStream) else PulledItem(got[0], None)), time.time()
        got = ray.get(self.source.pull.remote(self.rank, 0, list(acks)))
        if isinstance(got, PulledItem):
            ray.get(got.payload_ref)
        return got, time.time()

    def start_pull(self, eff: StartPull) -> None:
        self.pending = self.ex.submit(self._fetch, eff.acks)

    def pull_answered(self, _: PullAnswered) -> bool:
        return self.pending.done()

    def await_pull(self, _: AwaitPull) -> Fetched:
        t0 = time.time()
        got, t_received = self.pending.result()
        self.waits.append((t0, time.time()))
        return Fetched(got, t_received, self.waits[-1][1] - t0)

    def compute(self, eff: Compute) -> None:
        meta = eff.item.meta
        self.items.append((self.reduces, meta.job_id, meta.bucket, eff.payload))
        time.sleep(self.cost[meta.bucket])

    def send_acks(self, eff: SendAcks) -> None:
        import ray

        if self.is_pool:
            ray.get(self.source.ack.remote(self.rank, list(eff.job_ids)))

    def reduce(self, eff: Reduce) -> StepTotals:
        import ray

        votes = ray.get(self.barrier.arrive.remote(("reduce", self.reduces), self.rank, eff))
        totals = sum_votes(votes, self.optimizer_steps)
        self.reduces, self.optimizer_steps = self.reduces + 1, totals.step
        return totals

    def sleep(self, eff: Sleep) -> None:
        time.sleep(eff.seconds)

    def gather(self, eff: Gather) -> list:
        import ray

        return ray.get(self.barrier.arrive.remote(("gather", self.reduces), self.rank, list(eff.job_ids)))


class SleepDrafter:
    """One lockstep rank: the drafter's own step protocol (app/training/loop.py, which actors/drafter.py
    drives) with a sleep of the item's cost for compute and a barrier actor for the collectives."""

    def ready(self) -> bool:
        return True

    def run(self, source, is_pool: bool, rank: int, cost: list[float], barrier) -> dict:
        ops = _SleepOps(source, is_pool, rank, cost, barrier)
        drive(RankLoop(LoopConfig(rank, NUM_DRAFTERS, ACCUM)), ops)
        ops.ex.shutdown(wait=False)
        return {"items": ops.items, "waits": ops.waits}
