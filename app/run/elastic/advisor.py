"""Split advisor: how many GPUs should be targets and how many drafters, from measured rates.

Pure. Each side's *capacity* is measured while it works, so it does not matter which side is the
bottleneck now:
- a target's rate is its tokens per second of forward time (`tokens_by_target / forward_s_by_target`
  in the pool's stats): what it produces when it is never starved of jobs;
- a drafter rank's rate is its tokens per second of compute (step time minus data wait, summed over
  its step records): what it trains when it never waits for data.

The pipeline's throughput on a split of the same GPUs is then min(targets x target rate, drafters x
drafter rate); the advice is the split that maximises it, and its gain is that estimate over the same
estimate for the current split (both sides of the ratio come from one model, so a bias in it cancels).
Drafter ranks are assumed to keep their per-rank rate at another group size: the all-reduce cost per
step changes little with the number of ranks on one node.

With `costs` (`faults.virtual_clock`: the injected delays) each side is charged its delay instead of
its measured time: a target `done_by_target x target delay`, a rank `micro-batches x drafter delay`,
both at one tokens-per-job figure (`_virtual_rates`).
The rates then follow the delays, not how a busy machine's scheduler shares the CPU (beside two busy
loops a drafter micro-batch measured ~12.6 s against 2.1 s for a target forward, the drafter step's
all-reduce waiting for the most-starved rank, and the measured advice went the wrong way).

The advice is shown only once it is *stable*: every side has enough samples and the recommended
split has not changed for `hold_s` seconds of updates.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

# A split change has a cost (a restart); below this gain the advice is to keep the split.
MIN_GAIN = 0.05
# Samples needed before the rates mean anything: step records per drafter rank, jobs per target.
MIN_STEPS_PER_RANK = 5
MIN_JOBS_PER_TARGET = 3
# Each rank's first steps include warm-up (allocations, first pulls); leave them out of its rate.
WARMUP_STEPS = 1


@dataclass(frozen=True)
class SplitAdvice:
    """A recommended split, the current one, and the numbers behind the recommendation."""

    targets: int
    drafters: int
    current_targets: int
    current_drafters: int
    gain: float  # predicted tokens/s of the advised split / predicted tokens/s of the current one - 1
    target_tok_s: float  # per target, while computing
    drafter_tok_s: float  # per drafter rank, while computing
    predicted_tok_s: float  # of the advised split
    current_predicted_tok_s: float
    bound_now: str  # "targets" or "drafters": the side that limits the current split
    stable: bool
    samples: dict[str, int] = field(default_factory=dict)

    @property
    def changes(self) -> bool:
        return (self.targets, self.drafters) != (self.current_targets, self.current_drafters)

    def text(self) -> str:
        """`advice: 4 targets / 4 drafters (+18% tokens/s)`, or a keep-the-split line."""
        if not self.changes:
            return f"advice: keep {self.targets} targets / {self.drafters} drafters"
        return f"advice: {self.targets} targets / {self.drafters} drafters ({100 * self.gain:+.0f}% tokens/s)"

    def to_dict(self) -> dict:
        return {**asdict(self), "text": self.text()}


def best_split(num_targets: int, num_drafters: int, target_tok_s: float, drafter_tok_s: float,
               gpus_per_target: float = 1.0, gpus_per_drafter: float = 1.0) -> tuple[int, int, float, float]:
    """(targets, drafters, predicted tok/s, current predicted tok/s) over every split of the same GPUs
    with at least one of each; a tie, or a gain under MIN_GAIN, keeps the current split."""
    gt, gd = _unit(gpus_per_target), _unit(gpus_per_drafter)
    total = num_targets * gt + num_drafters * gd

    def tok_s(t: int, d: int) -> float:
        return min(t * target_tok_s, d * drafter_tok_s)

    current = tok_s(num_targets, num_drafters)
    best = (num_targets, num_drafters, current)
    t = 1
    while t * gt + gd <= total + 1e-9:
        d = int((total - t * gt) / gd + 1e-9)
        if d >= 1 and tok_s(t, d) > best[2] * (1 + 1e-9):
            best = (t, d, tok_s(t, d))
        t += 1
    if current > 0 and best[2] < current * (1 + MIN_GAIN):
        best = (num_targets, num_drafters, current)
    return best[0], best[1], best[2], current


def _unit(gpus: float) -> float:
    # A CPU topology gives actors 0 GPUs: count actors then.
    return gpus if gpus > 0 else 1.0


class SplitAdvisor:
    """Folds step records and pool snapshots into rates; `advice()` once they are stable.

    Fed the same stream as the RunMonitor (it is one of its listeners), or a finished run's timeline
    (app/advise.py `advise_from_timeline`).
    """

    def __init__(self, num_targets: int, num_drafters: int, gpus_per_target: float = 1.0,
                 gpus_per_drafter: float = 1.0, hold_s: float = 20.0, clock=time.monotonic,
                 half_life_s: float | None = None, costs: tuple[float, float] | None = None) -> None:
        """`half_life_s`: None measures since the start (or the last re-split); a number weighs the
        samples by recency (halved every `half_life_s`), so a balance that shifts mid-run shows.
        `costs`: (seconds per target forward, per drafter micro-batch) charged instead of the measured times."""
        assert costs is None or min(costs) > 0, costs  # FaultsConfig refuses a virtual clock without both delays
        self.num_targets, self.num_drafters = num_targets, num_drafters
        self.costs = costs
        self.gpus_per_target, self.gpus_per_drafter = gpus_per_target, gpus_per_drafter
        self.hold_s, self.clock, self.half_life_s = hold_s, clock, half_life_s
        self._decayed_at = clock()
        self.rank_steps: dict[int, int] = {}
        self.rank_tokens: dict[int, int] = {}
        self.rank_compute_s: dict[int, float] = {}
        self.target_tokens: dict[int, int] = {}
        self.target_forward_s: dict[int, float] = {}
        self.target_jobs: dict[int, int] = {}
        self._same_since: float | None = None
        self._last_split: tuple[int, int] | None = None
        # The pool's per-target counters are cumulative: after a re-split the rates count from these.
        self._base: dict[str, dict[int, float]] = {}
        self._raw: dict[str, dict[int, float]] = {}

    @classmethod
    def for_topology(cls, topo, **kw) -> "SplitAdvisor":
        """From a `TopologyConfig` (or anything with its four fields)."""
        return cls(topo.num_targets, topo.num_drafters, topo.gpus_per_target, topo.gpus_per_drafter, **kw)

    @classmethod
    def for_run(cls, cfg) -> "SplitAdvisor":
        """The live run's advisor: `topology.rebalance_half_life_s` (0: since the start) and, with
        `faults.virtual_clock`, the injected delays as each side's cost."""
        faults = cfg.faults
        costs = (faults.target_delay_s, faults.drafter_delay_s) if faults.virtual_clock else None
        return cls.for_topology(cfg.topology, half_life_s=cfg.topology.rebalance_half_life_s or None, costs=costs)

    # ---- inputs ---------------------------------------------------------------------------

    def add_records(self, records) -> None:
        """StepRecords (or dicts with rank, tokens, compute_s)."""
        self._decay()
        for rec in records:
            rank, tokens, compute_s = _get(rec, "rank"), _get(rec, "tokens"), _get(rec, "compute_s")
            if self.costs is not None:  # its micro-batches (one per job) at the injected delay each
                compute_s = len(_get(rec, "job_ids")) * self.costs[1]
            seen = self.rank_steps.get(rank, 0)
            self.rank_steps[rank] = seen + 1
            if seen < WARMUP_STEPS:
                continue
            self.rank_tokens[rank] = self.rank_tokens.get(rank, 0) + tokens
            self.rank_compute_s[rank] = self.rank_compute_s.get(rank, 0.0) + compute_s

    def add_pool(self, stats) -> None:
        """A PoolStats (or its dict): cumulative tokens, forward seconds and jobs per target."""
        self._decay()
        prev = self._raw
        self._raw = {key: {int(k): v for k, v in dict(_get(stats, key)).items()}
                     for key in ("tokens_by_target", "forward_s_by_target", "done_by_target")}
        if self.costs is not None:  # every forward at the injected delay: the counter the rates divide by
            self._raw["forward_s_by_target"] = {t: n * self.costs[0] for t, n in self._raw["done_by_target"].items()}
        if self.half_life_s is None:
            since = {key: {t: v - self._since(key, t, v) for t, v in raw.items()} for key, raw in self._raw.items()}
        else:  # the decayed sums plus what each target did since the last snapshot
            held = {"tokens_by_target": self.target_tokens, "forward_s_by_target": self.target_forward_s}
            since = {key: {t: held.get(key, {}).get(t, 0) + v - self._prev(prev, key, t, v) for t, v in raw.items()}
                     for key, raw in self._raw.items()}
            since["done_by_target"] = {t: v - self._since("done_by_target", t, v)
                                       for t, v in self._raw["done_by_target"].items()}
        self.target_tokens, self.target_forward_s = since["tokens_by_target"], since["forward_s_by_target"]
        self.target_jobs = since["done_by_target"]
        self._track()

    def _prev(self, prev: dict, key: str, tid: int, value: float) -> float:
        last = prev.get(key, {}).get(tid, 0)
        return last if value >= last else 0

    def _decay(self) -> None:
        """Recency weights (half_life_s): every sum the rates are made of shrinks with time."""
        now = self.clock()
        if self.half_life_s is None or now <= self._decayed_at:
            self._decayed_at = max(self._decayed_at, now)
            return
        f = 0.5 ** ((now - self._decayed_at) / self.half_life_s)
        self._decayed_at = now
        for sums in (self.rank_tokens, self.rank_compute_s, self.target_tokens, self.target_forward_s):
            for k in sums:
                sums[k] *= f

    def _since(self, key: str, tid: int, value: float) -> float:
        base = self._base.get(key, {}).get(tid, 0)
        return base if value >= base else 0  # a recreated pool counts from zero again

    def resplit(self, num_targets: int, num_drafters: int) -> None:
        """The run now has another split: measure both sides afresh (the drafter ranks' rate at the
        new group size, the targets' from the counters as they stand), and wait for stability again."""
        self.num_targets, self.num_drafters = num_targets, num_drafters
        self.rank_steps, self.rank_tokens, self.rank_compute_s = {}, {}, {}
        self._base = {key: dict(raw) for key, raw in self._raw.items()}
        self.target_tokens, self.target_forward_s, self.target_jobs = {}, {}, {}
        self._same_since, self._last_split = None, None

    def note(self, _event: str) -> None:
        """Listener interface of the RunMonitor; faults do not change the rates."""

    # ---- estimate -------------------------------------------------------------------------

    def rates(self) -> tuple[float, float]:
        """(tokens/s per target, tokens/s per drafter rank), medians over actors that did work."""
        t = [self.target_tokens[i] / s for i, s in self.target_forward_s.items()
             if s > 0 and self.target_tokens.get(i, 0) > 0]
        d = [self.rank_tokens[r] / s for r, s in self.rank_compute_s.items() if s > 0 and self.rank_tokens.get(r)]
        if self.costs is not None:
            return self._virtual_rates(bool(t), bool(d))
        if self.half_life_s is not None and t:
            # Recency-weighted: a target that sat idle lately (the pool was full) keeps an old rate;
            # the pooled ratio weighs each target by its recent forward time instead.
            busy = [i for i, s in self.target_forward_s.items() if s > 0]
            t = [sum(self.target_tokens.get(i, 0) for i in busy) / sum(self.target_forward_s[i] for i in busy)]
        # Median: one restarted or half-idle actor does not drag the estimate.
        return (statistics.median(t) if t else 0.0), (statistics.median(d) if d else 0.0)

    def _virtual_rates(self, targets_worked: bool, ranks_worked: bool) -> tuple[float, float]:
        """`costs`: each side's rate is its delay's, at the tokens per job of both sides' jobs pooled. Per side,
        the jobs handled so far are not the same jobs (the targets run ahead by the buffer, and a bucket's jobs
        differ in length): their own tokens per job tilted the advice by up to 14% on the bench."""
        ct, cd = self.costs
        tokens = sum(self.target_tokens.values()) + sum(self.rank_tokens.values())
        jobs = sum(self.target_forward_s.values()) / ct + sum(self.rank_compute_s.values()) / cd
        per_job = tokens / jobs if jobs > 0 else 0.0
        return (per_job / ct if targets_worked else 0.0), (per_job / cd if ranks_worked else 0.0)

    def enough_samples(self) -> bool:
        ranks_ok = self.rank_steps and min(self.rank_steps.values()) >= MIN_STEPS_PER_RANK + WARMUP_STEPS
        targets_ok = self.target_jobs and max(self.target_jobs.values()) >= MIN_JOBS_PER_TARGET
        return bool(ranks_ok and targets_ok)

    def estimate(self, stable: bool | None = None) -> SplitAdvice | None:
        """The current recommendation whatever its stability; None before both rates exist."""
        rt, rd = self.rates()
        if rt <= 0 or rd <= 0:
            return None
        t, d, best, current = best_split(self.num_targets, self.num_drafters, rt, rd,
                                         self.gpus_per_target, self.gpus_per_drafter)
        return SplitAdvice(
            targets=t, drafters=d, current_targets=self.num_targets, current_drafters=self.num_drafters,
            gain=best / current - 1 if current > 0 else 0.0, target_tok_s=rt, drafter_tok_s=rd,
            predicted_tok_s=best, current_predicted_tok_s=current,
            bound_now="targets" if self.num_targets * rt < self.num_drafters * rd else "drafters",
            stable=self.is_stable() if stable is None else stable,
            samples={"drafter_steps": sum(self.rank_steps.values()), "target_jobs": sum(self.target_jobs.values())},
        )

    def is_stable(self) -> bool:
        return (self.enough_samples() and self._same_since is not None
                and self.clock() - self._same_since >= self.hold_s)

    def advice(self) -> SplitAdvice | None:
        """The recommendation once it is stable, else None (the status line shows nothing yet)."""
        est = self.estimate()
        return est if est is not None and est.stable else None

    def _track(self) -> None:
        est = self.estimate(stable=False)
        split = (est.targets, est.drafters) if est is not None and self.enough_samples() else None
        if split != self._last_split:
            self._last_split, self._same_since = split, (self.clock() if split else None)


def _get(obj, name: str):
    return obj[name] if isinstance(obj, dict) else getattr(obj, name)
