"""A discrete-event simulation of the pipeline around the real pool policy (`HSPool`), on a virtual
clock: targets that take `target_cost[bucket]` per job (one at a time, `jobs_in_flight_per_target`
queued), and drafter ranks in lockstep (an all-reduce barrier per step) that prefetch one pull while
they compute `drafter_cost[bucket]` per item, step every `accum` items (or on `Drained`), and send
their acks with the next pull, exactly as `actors/drafter.py` does. Pull and ack messages take
`latency / 2` each way.

Seconds of simulated run cost milliseconds, so tests and `python -m app.bench sched --sim` can look
at thousands of steps. The measures are the ones `app/pool/measures.py` defines for every policy.
"""
from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from app.config.schema import PoolConfig
from app.data.schedule import interleave
from app.messages import Drained, EndOfStream, ItemMeta, JobSpec, PulledItem
from app.pool.measures import BacklogMeter, bucket_counts, shares_of, step_tv, step_tv_floor, tail_single
from app.pool.hs_pool import HSPool
from app.pool.pull_policy import PullPolicy


@dataclass(frozen=True)
class SimSetup:
    mix: Sequence[int]  # jobs per bucket in one schedule period (their ratio is what matters)
    jobs: int
    drafter_cost: Sequence[float]  # seconds per item, by bucket
    target_cost: Sequence[float]  # seconds per job, by bucket
    ranks: int = 3
    accum: int = 4
    targets: int = 5
    latency: float = 0.003  # round trip of a pull (or an ack riding on it)
    jitter: float = 0.15  # costs vary uniformly by +-jitter
    warmup: float = 2.0  # seconds left out of busy and backlog (the pool fills)
    pool: PoolConfig = field(default_factory=PoolConfig)
    seed: int = 0
    rows: Sequence[float] = ()  # mean query rows of a job per bucket: jobs carry their cost (JobSpec.cost)
    # and the pool deals for it; () = costs unknown to the pool. A job's time scales with its rows.


@dataclass
class SimResult:
    steps: list[list[int]]  # per global step: items per bucket
    step_costs: list[list[float]]  # per global step: each rank's drafter cost
    busy: list[float]  # per rank: 1 - data-wait share over the measured window
    compute_share: list[float]  # per rank: compute time / window (lockstep idle counts against it)
    backlog: float
    schedule: list[int]  # bucket of each job in schedule order
    step_items: int
    t_produced: float
    t_end: float
    pool_stats: object

    def measures(self) -> dict[str, float]:
        n = len(self.steps[0]) if self.steps else 0
        shares = shares_of(bucket_counts(self.schedule, n))
        spreads = self.rank_cost_spreads()
        return {
            "step_tv": step_tv(self.steps, shares),
            "step_tv_floor": step_tv_floor(self.schedule, self.step_items, n, shares),
            "backlog": self.backlog,
            "tail_single": tail_single(self.steps),
            "busy_min": min(self.busy),
            "rank_cost_spread": max(spreads, default=float("nan")),
            "rank_cost_spread_mean": sum(spreads) / len(spreads) if spreads else float("nan"),
            "barrier_idle": 1.0 - min(b + c - 1.0 for b, c in zip(self.busy, self.compute_share)) - 0.0,
        }

    def rank_cost_spreads(self) -> list[float]:
        """(max - min) / mean of the ranks' drafter cost, per full step (every rank took its share)."""
        out = []
        for step, costs in zip(self.steps, self.step_costs):
            if sum(step) == self.step_items and min(costs) > 0:
                out.append((max(costs) - min(costs)) / (sum(costs) / len(costs)))
        return out


def schedule_of(mix: Sequence[int], jobs: int) -> list[int]:
    """Buckets of `jobs` jobs in the data pipeline's own interleaved order (app.data.schedule)."""
    counts = [round(jobs * m / sum(mix)) for m in mix]
    counts[max(range(len(mix)), key=lambda b: mix[b])] += jobs - sum(counts)
    return [b for b, _ in interleave(counts, list(range(len(mix))))]


def simulate(setup: SimSetup, policy: str | PullPolicy | None = None,
             job_cost: Callable[[JobSpec], float] | None = None) -> SimResult:
    """Run the whole schedule through the pool; `job_cost` (default: by bucket) is a job's drafter cost."""
    return _Sim(setup, policy, job_cost).run()


class _Sim:
    def __init__(self, s: SimSetup, policy, job_cost) -> None:
        self.s, self.now = s, 0.0
        self.rng = random.Random(s.seed)
        self.pool = HSPool(s.pool, len(s.mix), pull_policy=policy, clock=lambda: self.now,
                           ranks=s.ranks, accum=s.accum)
        self.schedule = schedule_of(s.mix, s.jobs)
        jit = [self._jit() for _ in self.schedule]
        self.jobs = [JobSpec(i, 0, i, b, (i,), 64, 1, round(s.rows[b] * jit[i]) if s.rows else 0)
                     for i, b in enumerate(self.schedule)]
        self.pool.add_jobs(self.jobs)
        self.pool.finish_adding()
        self.cost = {j.job_id: (job_cost(j) if job_cost else s.drafter_cost[j.bucket]) * jit[j.job_id] for j in self.jobs}
        self.events: list = []
        self.seq = itertools.count()
        self.target_free = [0.0] * s.targets
        self.waiting_pulls: list[int] = []  # ranks whose pull is at the pool, in arrival order
        r = range(s.ranks)
        self.result: list = [None] * s.ranks  # a delivered pull not yet consumed
        self.pending = [False] * s.ranks
        self.wait_from: list[float | None] = [None] * s.ranks
        self.acks: list[list[int]] = [[] for _ in r]
        self.step_items: list[list[int]] = [[] for _ in r]
        self.eos = [False] * s.ranks
        self.arrived: set[int] = set()
        self.compute = [0.0] * s.ranks
        self.waited = [0.0] * s.ranks
        self.spans: list[tuple[int, str, float, float]] = []  # (rank, kind, start, end)
        self.steps: list[list[int]] = []
        self.step_costs: list[list[float]] = []
        self.backlog = BacklogMeter()
        self.t_produced = 0.0
        self.finished = False

    def _jit(self) -> float:
        return 1.0 + self.s.jitter * (2 * self.rng.random() - 1)

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn, args))

    def run(self) -> SimResult:
        self.dispatch()
        for rank in range(self.s.ranks):
            self.need_item(rank)
        while self.events and not self.finished:
            self.now, _, fn, args = heapq.heappop(self.events)
            fn(*args)
            self.serve()
        window = max(1e-9, self.t_produced - self.s.warmup)
        busy = [1.0 - self._overlap(r, "wait") / window for r in range(self.s.ranks)]
        share = [self._overlap(r, "compute") / window for r in range(self.s.ranks)]
        return SimResult(self.steps, self.step_costs, busy, share, self.backlog.value(), self.schedule,
                         self.s.ranks * self.s.accum, self.t_produced, self.now, self.pool.stats())

    def _overlap(self, rank: int, kind: str) -> float:
        lo, hi = self.s.warmup, self.t_produced
        return sum(max(0.0, min(b, hi) - max(a, lo)) for r, k, a, b in self.spans if r == rank and k == kind)

    # ---- targets ---------------------------------------------------------------------------

    def dispatch(self) -> None:
        for t in range(self.s.targets):
            while (job := self.pool.next_job(t)) is not None:
                start = max(self.now, self.target_free[t])
                self.target_free[t] = start + self.s.target_cost[job.bucket] * self._jit()
                self.at(self.target_free[t], self.land, t, job)

    def land(self, t: int, job: JobSpec) -> None:
        self.pool.job_done(t, ItemMeta(job.job_id, job.bucket, 1, 64, 64, 1, t, 0.0), None)
        if self.pool.producing_finished and not self.t_produced:
            self.t_produced = self.now
        self._track()
        self.dispatch()

    def _track(self) -> None:
        active = self.now >= self.s.warmup and not self.t_produced
        self.backlog.update(self.now, self.pool.stats().q_hsb, active)

    # ---- pulls -----------------------------------------------------------------------------

    def issue_pull(self, rank: int) -> None:
        self.pending[rank] = True
        acks, self.acks[rank] = self.acks[rank], []
        self.at(self.now + self.s.latency / 2, self.pull_arrives, rank, acks)

    def pull_arrives(self, rank: int, acks: list[int]) -> None:
        if acks:
            self.pool.ack(rank, acks)
        self.waiting_pulls.append(rank)

    def serve(self) -> None:
        served = True
        while served:
            served = False
            for rank in list(self.waiting_pulls):
                got = self.pool.try_pull(rank)
                if got is not None:
                    self.waiting_pulls.remove(rank)
                    self.at(self.now + self.s.latency / 2, self.deliver, rank, got)
                    served = True
                    if isinstance(got, PulledItem):
                        self._track()
                        self.dispatch()

    def deliver(self, rank: int, got) -> None:
        self.pending[rank], self.result[rank] = False, got
        if self.wait_from[rank] is not None:
            self.spans.append((rank, "wait", self.wait_from[rank], self.now))
            self.wait_from[rank] = None
            self.need_item(rank)

    # ---- drafters --------------------------------------------------------------------------

    def need_item(self, rank: int) -> None:
        """The rank wants its next micro-batch (DrafterActor._accumulate -> _Prefetcher.next)."""
        got = self.result[rank]
        if got is None:
            if not self.pending[rank]:
                self.issue_pull(rank)
            self.wait_from[rank] = self.now
            return
        self.result[rank] = None
        if isinstance(got, (Drained, EndOfStream)):
            self.eos[rank] = self.eos[rank] or isinstance(got, EndOfStream)
            self.arrive(rank)
            return
        self.issue_pull(rank)  # prefetch the next while this one computes
        jid = got.meta.job_id
        self.step_items[rank].append(jid)
        cost = self.cost[jid]
        self.spans.append((rank, "compute", self.now, self.now + cost))
        self.at(self.now + cost, self.computed, rank)

    def computed(self, rank: int) -> None:
        if len(self.step_items[rank]) < self.s.accum:
            self.need_item(rank)
        else:
            self.arrive(rank)

    def arrive(self, rank: int) -> None:
        self.arrived.add(rank)
        if len(self.arrived) < self.s.ranks:
            return
        self.arrived.clear()
        ids = [self.step_items[r] for r in range(self.s.ranks)]
        if any(ids):
            self.steps.append(bucket_counts((self.jobs[j].bucket for r in ids for j in r), len(self.s.mix)))
            self.step_costs.append([sum(self.cost[j] for j in r) for r in ids])
            for j_ids in ids:
                self.pool.record_step(len(self.steps), j_ids)
        for r in range(self.s.ranks):
            self.acks[r] += ids[r]
            self.step_items[r] = []
        if all(self.eos):
            self.finished = True
            return
        delay = 0.0 if any(ids) else 0.05  # all ranks dry: DrafterActor sleeps 50 ms and pulls again
        for r in range(self.s.ranks):
            if self.eos[r]:
                self.at(self.now + delay, self.arrive, r)
            else:
                self.at(self.now + delay, self.need_item, r)
