"""A discrete-event simulation of the pipeline around the real pool (`HSPool`), on a virtual clock:
targets that take `target_cost[bucket]` per job (one at a time, `jobs_in_flight_per_target` queued), and
drafter ranks that run the drafter's own step protocol (`app/training/loop.py`, the code
`actors/drafter.py` drives), each rank's loop advanced from the event heap: a micro-batch costs
`drafter_cost[bucket]` of virtual time, the reduce and the all-gather wait for every rank, acks ride
on the next pull or go at once exactly where the actor sends them. Pull and ack messages take
`latency / 2` each way.

Seconds of simulated run cost milliseconds, so tests and `python -m app.bench sched --sim` can look
at thousands of steps. The measures are the ones `app/pool/telemetry.py` defines for every policy.
"""
from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from app.config.schema import PoolConfig
from app.data.schedule import interleave
from app.messages import ItemMeta, JobSpec, PulledItem
from app.pool.telemetry import BacklogMeter, bucket_counts, shares_of, step_tv, step_tv_floor, tail_single
from app.pool.hs_pool import HSPool
from app.pool.pull_policy import PullPolicy
from app.training.effects import (AwaitPull, Compute, Fetched, Gather, LoopConfig, PullAnswered, Reduce, SendAcks,
                                  Sleep, StartPull, StepDone, sum_votes)
from app.training.loop import LATER, QuietHooks, RankLoop, Runner


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
    order: Sequence[int] = ()  # the bucket of each job in schedule order; () = the pipeline's interleaving of mix


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
    return Simulation(setup, policy, job_cost).run()


class Simulation:
    """The event heap, the pool, the targets and the ranks of one simulated run (see the module docstring)."""

    def __init__(self, s: SimSetup, policy, job_cost) -> None:
        self.s, self.now = s, 0.0
        self.rng = random.Random(s.seed)
        self.pool = HSPool(s.pool, len(s.mix), pull_policy=policy, clock=lambda: self.now,
                           ranks=s.ranks, accum=s.accum)
        self.schedule = list(s.order) if s.order else schedule_of(s.mix, s.jobs)
        jit = [self._jit() for _ in self.schedule]
        self.jobs = [JobSpec(i, 0, i, b, (i,), 64, 1, round(s.rows[b] * jit[i]) if s.rows else 0)
                     for i, b in enumerate(self.schedule)]
        self.pool.add_jobs(self.jobs)
        self.pool.finish_adding()
        self.cost = {j.job_id: (job_cost(j) if job_cost else s.drafter_cost[j.bucket]) * jit[j.job_id] for j in self.jobs}
        self.events: list = []
        self.seq = itertools.count()
        self.target_free = {t: 0.0 for t in range(s.targets)}  # the live targets (a re-split changes them)
        self.waiting_pulls: list[int] = []  # ranks whose pull is at the pool, in arrival order
        self.generation = 0  # of the drafter group: messages of an earlier group are dropped
        self.ranks = [SimRank(self, r) for r in range(s.ranks)]
        self.stop = False  # rank 0 reads it: the group checkpoints and returns (a re-split's stop)
        self.trained: set[int] = set()  # job ids of completed steps: the ledger a checkpoint would hold
        # Hooks for app/bench/feeding/resplit_sim.py: each rank's step (rank, job ids, compute s), each landed
        # job, and the group's end (True: a new group was started, go on).
        self.on_step: Callable[[int, tuple, float], None] | None = None
        self.on_land: Callable[[], None] | None = None
        self.on_end: Callable[[], bool] | None = None
        self.arrivals: dict[str, dict[int, object]] = {}  # collective -> rank -> its value, until all came
        self.optimizer_steps = 0
        self.spans: list[tuple[int, str, float, float]] = []  # (rank, kind, start, end)
        self.steps: list[list[int]] = []
        self.step_costs: list[list[float]] = []
        self.backlog = BacklogMeter()
        self.t_produced = 0.0

    def _jit(self) -> float:
        return 1.0 + self.s.jitter * (2 * self.rng.random() - 1)

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn, args))

    def run(self) -> SimResult:
        self.dispatch()
        for rank in self.ranks:
            rank.runner.resume()
        while True:
            if all(r.runner.done for r in self.ranks) and not (self.on_end and self.on_end()):
                break
            if not self.events:
                break
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
        for t in list(self.target_free):
            while (job := self.pool.next_job(t)) is not None:
                start = max(self.now, self.target_free[t])
                cost = self.s.target_cost[job.bucket] * self._jit()
                self.target_free[t] = start + cost
                self.at(self.target_free[t], self.land, t, job, cost)

    def land(self, t: int, job: JobSpec, cost: float = 0.0) -> None:
        self.pool.job_done(t, ItemMeta(job.job_id, job.bucket, 1, 64, 64, 1, t, cost), None)  # stale: dropped
        if self.on_land:
            self.on_land()
        if self.pool.producing_finished and not self.t_produced:
            self.t_produced = self.now
        self._track()
        self.dispatch()

    def _track(self) -> None:
        active = self.now >= self.s.warmup and not self.t_produced
        self.backlog.update(self.now, self.pool.stats().q_hsb, active)

    # ---- pulls and acks --------------------------------------------------------------------

    def pull_arrives(self, rank: int, acks: list[int], generation: int = 0) -> None:
        if generation != self.generation:
            return  # sent by a group that is gone (its acks are in the ledger the new group resumed from)
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
                    self.at(self.now + self.s.latency / 2, self.ranks[rank].deliver, got)
                    served = True
                    if isinstance(got, PulledItem):
                        self._track()
                        self.dispatch()

    # ---- the ranks' collectives -------------------------------------------------------------

    def collective(self, kind: str, rank: int, value) -> None:
        """The reduce or the all-gather: once every rank arrived, all resume now with the result."""
        came = self.arrivals.setdefault(kind, {})
        came[rank] = value
        if len(came) < len(self.ranks):
            return
        values = [came[r] for r in range(len(self.ranks))]
        del self.arrivals[kind]
        result = values
        if kind == "reduce":
            result = sum_votes(values, self.optimizer_steps)
            self.optimizer_steps = result.step
        for r in self.ranks:
            self.at(self.now, r.runner.resume, result)

    def step_done(self, rank: int, done: StepDone) -> None:
        self.pool.record_step(done.step, done.job_ids)  # each rank reports its own jobs, as the actor does
        if self.on_step:
            self.on_step(rank, done.job_ids, sum(self.cost[j] for j in done.job_ids))
        if rank == 0:
            self.trained.update(j for ids in done.gathered for j in ids)
            self.steps.append(bucket_counts((self.jobs[j].bucket for ids in done.gathered for j in ids),
                                            len(self.s.mix)))
            self.step_costs.append([sum(self.cost[j] for j in ids) for ids in done.gathered])


class SimRank(QuietHooks):
    """One rank's loop operations on the virtual clock: the blocking ones answer LATER and resume the
    rank's loop from the event heap."""

    def __init__(self, sim: "Simulation", rank: int, world_size: int | None = None, start_step: int = 0) -> None:
        self.sim, self.rank, self.generation = sim, rank, sim.generation
        world = sim.s.ranks if world_size is None else world_size
        self.runner = Runner(RankLoop(LoopConfig(rank, world, sim.s.accum, start_step=start_step)), self)
        self.answer = None  # a delivered pull answer the loop has not awaited yet
        self.wait_from: float | None = None  # the loop awaits since then

    def start_pull(self, eff: StartPull) -> None:
        self.sim.at(self.sim.now + self.sim.s.latency / 2, self.sim.pull_arrives, self.rank, list(eff.acks),
                    self.generation)

    def read_stop(self, _) -> bool:
        return self.sim.stop

    def pull_answered(self, _: PullAnswered) -> bool:
        return self.answer is not None

    def await_pull(self, _: AwaitPull):
        if self.answer is None:
            self.wait_from = self.sim.now
            return LATER
        got, self.answer = self.answer, None
        return Fetched(got)

    def deliver(self, got) -> None:
        if self.wait_from is None:
            self.answer = got
            return
        sim = self.sim
        sim.spans.append((self.rank, "wait", self.wait_from, sim.now))
        waited, self.wait_from = sim.now - self.wait_from, None
        self.runner.resume(Fetched(got, None, waited))

    def compute(self, eff: Compute):
        sim, cost = self.sim, self.sim.cost[eff.item.meta.job_id]
        sim.spans.append((self.rank, "compute", sim.now, sim.now + cost))
        sim.at(sim.now + cost, self.runner.resume)
        return LATER

    def send_acks(self, eff: SendAcks):
        sim = self.sim
        sim.at(sim.now + sim.s.latency / 2, sim.pool.ack, self.rank, list(eff.job_ids))
        sim.at(sim.now + sim.s.latency, self.runner.resume)  # the call returns after a round trip
        return LATER

    def reduce(self, eff: Reduce):
        self.sim.collective("reduce", self.rank, eff)
        return LATER

    def gather(self, eff: Gather):
        self.sim.collective("gather", self.rank, list(eff.job_ids))
        return LATER

    def sleep(self, eff: Sleep):
        self.sim.at(self.sim.now + eff.seconds, self.runner.resume)
        return LATER

    def step_done(self, eff: StepDone) -> None:
        self.sim.step_done(self.rank, eff)
