"""Automatic re-splits on the discrete-event simulation (`app/bench/feeding/simulate.py`: the real pool, the real
step loop, a virtual clock), with the real advisor (`app/run/elastic/advisor.py`) and trigger (`app/run/elastic/resplit.py`).

A run whose balance shifts: long sequences first (a target job costs more than a drafter micro-batch:
attention grows with length on the target, the drafter trains fixed-size blocks), short ones later (the
reverse). `run_auto` starts at a split and lets the trigger re-split as the real supervisor does: the
group stops at a step boundary, the pool rolls back to the jobs of completed steps (what the checkpoint
would hold), targets are retired or added, and a group of the new size starts after `resplit_cost_s`.
`run_fixed` is the same schedule on one split throughout; the best of those in hindsight is the bar.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

from app.bench.feeding.simulate import SimSetup, Simulation, SimRank
from app.run.elastic.advisor import SplitAdvisor
from app.run.elastic.resplit import Rebalancer

TOKENS_PER_JOB = 64  # what the simulated jobs carry (ItemMeta in simulate.py)


def shifting_setup(jobs: int = 1200, targets: int = 5, ranks: int = 3, seed: int = 0) -> SimSetup:
    """Two buckets: long jobs (target 1.0 s, drafter 0.35 s) for the first 40%, then short ones
    (target 0.2 s, drafter 0.5 s); the best split for the first phase is targets-heavy, for the second
    drafters-heavy."""
    long_jobs = int(0.4 * jobs)
    return SimSetup(mix=(1, 1), jobs=jobs, drafter_cost=(0.5, 0.35), target_cost=(0.2, 1.0), ranks=ranks,
                    accum=1, targets=targets, seed=seed, order=[1] * long_jobs + [0] * (jobs - long_jobs))


def run_fixed(setup: SimSetup, targets: int, ranks: int) -> float:
    """The virtual seconds the whole schedule takes on one split."""
    sim = Simulation(dataclasses.replace(setup, targets=targets, ranks=ranks), None, None)
    sim.run()
    return sim.now


class _Auto:
    """The supervisor's re-split, on the simulation: the advisor and the trigger fed its steps and pool."""

    def __init__(self, sim: Simulation, hold_s: float, min_gain: float, max_rebalances: int, cost_s: float,
                 half_life_s: float | None) -> None:
        self.sim, self.cost_s = sim, cost_s
        t, d = len(sim.target_free), len(sim.ranks)
        self.advisor = SplitAdvisor(t, d, hold_s=0, clock=lambda: sim.now, half_life_s=half_life_s)
        self.trigger = Rebalancer("auto", hold_s, min_gain, max_rebalances, t, d, window_s=hold_s)
        self.tokens = 0
        self.trained: Counter[int] = Counter()  # every rank's jobs of every step, counted apart from the pool
        self.pending = None
        self.next_tid = t
        self.splits: list[tuple[float, tuple[int, int], tuple[int, int]]] = []  # (time, old, new)
        sim.on_step, sim.on_land, sim.on_end = self.step, self.land, self.end

    def step(self, rank: int, job_ids: tuple, compute_s: float) -> None:
        self.tokens += TOKENS_PER_JOB * len(job_ids)
        self.trained.update(job_ids)
        self.advisor.add_records([{"rank": rank, "tokens": TOKENS_PER_JOB * len(job_ids), "compute_s": compute_s}])

    def land(self) -> None:
        sim = self.sim
        self.advisor.add_pool(sim.pool.stats())
        self.trigger.tokens(self.tokens, sim.now)
        if self.pending is None and not sim.pool.producing_finished:
            est = self.advisor.estimate(stable=True) if self.advisor.enough_samples() else None
            for rs in self.trigger.observe(est, sim.now):
                self.pending, sim.stop = rs, True

    def end(self) -> bool:
        """Every rank returned: a re-split's stop starts the new group; the end of the run does not."""
        sim, rs = self.sim, self.pending
        if rs is None or sim.pool.done:
            return False
        new_t, new_d = rs.new
        for tid in sorted(sim.target_free)[new_t:]:  # targets -> drafters
            del sim.target_free[tid]
            sim.pool.target_lost(tid)  # its in-flight jobs back to the queue; its late results are stale
        while len(sim.target_free) < new_t:  # drafters -> targets
            sim.target_free[self.next_tid] = sim.now + self.cost_s
            self.next_tid += 1
        sim.pool.rollback(sim.trained)
        sim.pool.set_ranks(new_d)
        sim.generation += 1
        sim.waiting_pulls.clear()
        step = max((r.runner.outcome.steps for r in sim.ranks), default=0)
        sim.ranks = [SimRank(sim, r, new_d, step) for r in range(new_d)]
        sim.stop, self.pending = False, None
        self.splits.append((sim.now, rs.old, rs.new))
        self.advisor.resplit(new_t, new_d)
        self.trigger.done(new_t, new_d, now=sim.now + self.cost_s, tokens=self.tokens)
        for rank in sim.ranks:
            sim.at(sim.now + self.cost_s, rank.runner.resume)
        sim.at(sim.now + self.cost_s, sim.dispatch)
        return True


def run_auto(setup: SimSetup, hold_s: float = 20.0, min_gain: float = 0.15, max_rebalances: int = 3,
             cost_s: float = 10.0, half_life_s: float | None = 10.0) -> tuple[float, list, Counter]:
    """(virtual seconds, re-splits as (time, old, new), times each job was trained) with rebalance=auto.
    A stop's last step is kept (the checkpoint holds it), so no job should be trained twice."""
    sim = Simulation(setup, None, None)
    auto = _Auto(sim, hold_s, min_gain, max_rebalances, cost_s, half_life_s)
    sim.run()
    return sim.now, auto.splits, auto.trained


def compare(setup: SimSetup, splits: Sequence[tuple[int, int]] | None = None, **auto_kw) -> dict:
    """Auto against every fixed split of the same GPUs (with at least one of each)."""
    total = setup.targets + setup.ranks
    splits = splits or [(t, total - t) for t in range(1, total)]
    fixed = {f"{t}/{d}": run_fixed(setup, t, d) for t, d in splits}
    auto_s, resplits, trained = run_auto(setup, **auto_kw)
    best = min(fixed, key=fixed.get)
    return {"fixed_s": fixed, "best_fixed": best, "best_fixed_s": fixed[best], "auto_s": auto_s,
            "resplits": resplits, "trained_once": sum(1 for c in trained.values() if c == 1),
            "trained_twice": sum(1 for c in trained.values() if c > 1), "never_trained": setup.jobs - len(trained),
            "jobs": setup.jobs}
