"""`python -m app.bench sched`: who starves and who mixes, on the real pool actor.

Sleeping producers (5 targets) and consumers (3 drafters); both costs grow with the tokens of a
job's bucket, the longest bucket dominates the job mix, and the targets out-supply the drafters
by 10% on average. Three layouts, same actors, same schedule, one run:
  (a) fair:   the HSPoolActor, bucket-fair pulls (round-robin over non-empty buckets);
  (b) rr:     one ray.util.queue.Queue per drafter, targets assigned round-robin (t -> t % 3);
  (c) random: the HSPoolActor with uniformly random pulls over buffered items.
Each drafter prefetches one pull while it computes and acks every 4 items (one grad-accum step).
busy = compute time / measured window; mixing = share of 4-pull windows (one step each) that
cover min(4, buckets non-empty at every pull of the window) distinct buckets: what the policy
could have mixed. Also printed: the stricter count against buckets non-empty at the window's
first pull, which other drafters may drain during the window (scarce short buckets are shared).
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from app.config.schema import PoolConfig
from app.messages import EndOfStream, HiddenBatch, ItemMeta, JobSpec, PulledItem

TOKENS = [256, 512, 1024, 1536, 2048, 3072]  # per job, by bucket
WEIGHTS = [1, 1, 1, 1, 2, 6]  # the longest bucket dominates
NUM_TARGETS, NUM_DRAFTERS, ACCUM = 5, 3, 4


def consume_cost(bucket: int, scale: float) -> float:
    return scale * (0.02 + 0.08 * TOKENS[bucket] / TOKENS[-1])


def mean_consume_cost(scale: float) -> float:
    return sum(w * consume_cost(b, scale) for b, w in enumerate(WEIGHTS)) / sum(WEIGHTS)


def produce_factor(supply: float = 1.10) -> float:
    """Producer cost / consumer cost so that 5 targets make `supply` x what 3 drafters eat."""
    return NUM_TARGETS / (supply * NUM_DRAFTERS)


def interleave(weights: list[int], n: int) -> list[int]:
    """Smooth weighted round-robin: a linear interleave of buckets in proportion to weights."""
    cur, total, out = [0] * len(weights), sum(weights), []
    for _ in range(n):
        cur = [c + w for c, w in zip(cur, weights)]
        b = max(range(len(cur)), key=cur.__getitem__)
        cur[b] -= total
        out.append(b)
    return out


def item(job: JobSpec, target_id: int, cost: float) -> tuple[ItemMeta, HiddenBatch]:
    hb = HiddenBatch(job.job_id, np.zeros((1, 4, 4), np.float32), "float32",
                     np.zeros((1, 4), np.int64), np.ones((1, 4), np.uint8), np.array([4]))
    return ItemMeta(job.job_id, job.bucket, 1, TOKENS[job.bucket], TOKENS[job.bucket], 64, target_id, cost), hb


class SleepTarget:
    """Sleeps cost(bucket) x factor per job; serves the pool (forward) or a queue (produce)."""

    def __init__(self, target_id: int, scale: float, factor: float) -> None:
        self.target_id, self.scale, self.factor = target_id, scale, factor

    def ready(self) -> bool:
        return True

    def forward(self, job: JobSpec) -> tuple[ItemMeta, HiddenBatch]:
        cost = consume_cost(job.bucket, self.scale) * self.factor
        time.sleep(cost)
        return item(job, self.target_id, cost)

    def produce(self, queue, jobs: list[JobSpec], t_end: float) -> int:
        from ray.util.queue import Full

        done = 0
        for job in jobs:
            if time.time() > t_end:
                break
            got = self.forward(job)
            while time.time() < t_end:
                try:
                    queue.put(got, timeout=0.25)
                    done += 1
                    break
                except Full:
                    continue
        return done


class SleepDrafter:
    """Pulls (one prefetched), sleeps cost(bucket), acks every ACCUM items; records compute spans."""

    def ready(self) -> bool:
        return True

    def run(self, source, is_pool: bool, drafter_id: int, scale: float, t_end: float) -> list:
        from concurrent.futures import ThreadPoolExecutor

        import ray

        def fetch():  # pull and read the payload, in the background while the last item computes
            ref = source.pull.remote(drafter_id) if is_pool else source.actor.get.remote(None)
            ready, _ = ray.wait([ref], timeout=max(0.0, t_end - time.time()))
            if not ready:
                return EndOfStream("bench over")
            got = ray.get(ref)
            if isinstance(got, PulledItem):
                return got.meta, ray.get(got.payload_ref)
            return got

        spans, held = [], []
        ex = ThreadPoolExecutor(1)
        nxt = ex.submit(fetch)
        while time.time() < t_end:
            got = nxt.result()
            if isinstance(got, EndOfStream):
                break
            nxt = ex.submit(fetch)  # prefetch the next while this one computes
            meta, _payload = got
            t0 = time.time()
            time.sleep(consume_cost(meta.bucket, scale))
            spans.append((meta.bucket, t0, time.time(), meta.num_tokens))
            held.append(meta.job_id)
            if is_pool and len(held) == ACCUM:
                source.ack.remote(drafter_id, held)
                held = []
        ex.shutdown(wait=False)  # a last prefetch may still wait; it ends with the bench window
        return spans


def busy_and_tokens(spans: list, t0: float, t1: float) -> tuple[float, float]:
    busy = tokens = 0.0
    for _, a, b, tok in spans:
        overlap = max(0.0, min(b, t1) - max(a, t0))
        busy += overlap
        tokens += tok * overlap / (b - a) if b > a else 0.0
    return busy / (t1 - t0), tokens / (t1 - t0)


def mixing(trace: list[tuple[int, int, int]], drafter: int, at_start_only: bool = False) -> float:
    """Share of this drafter's 4-pull windows (one grad-accum step each) that cover
    min(4, available) distinct buckets. available = buckets non-empty at every pull of the window
    (what the policy could have given throughout), or with at_start_only at the first pull."""
    mine = [(b, mask) for d, b, mask in trace if d == drafter]
    windows = [mine[i : i + ACCUM] for i in range(0, len(mine) - ACCUM + 1, ACCUM)]
    if not windows:
        return float("nan")
    ok = 0
    for w in windows:
        avail = w[0][1]
        if not at_start_only:
            for _, mask in w[1:]:
                avail &= mask
        ok += len({b for b, _ in w}) >= min(ACCUM, bin(avail).count("1"))
    return ok / len(windows)


def run_layout(ray, layout: str, targets, drafters, jobs, scale: float, dur: float, warm: float) -> dict:
    from actors.hs_pool import HSPoolActor, pool_max_concurrency

    t_start = time.time()
    t_end = t_start + dur
    if layout == "rr":
        from ray.util.queue import Queue

        queues = [Queue(maxsize=8) for _ in range(NUM_DRAFTERS)]
        [q.size() for q in queues]
        t_start = time.time()
        t_end = t_start + dur
        mine = [jobs[t::NUM_TARGETS] for t in range(NUM_TARGETS)]
        prods = [tg.produce.remote(queues[t % NUM_DRAFTERS], mine[t], t_end) for t, tg in enumerate(targets)]
        runs = [d.run.remote(queues[i], False, i, scale, t_end) for i, d in enumerate(drafters)]
        spans = ray.get(runs)
        ray.get(prods)
        trace = None
        for q in queues:
            q.shutdown()
    else:
        from app.bench.pull_policies import RandomPulls, TracedPulls
        from app.pool.pull_policy import RoundRobin

        inner = RoundRobin(len(TOKENS)) if layout == "fair" else RandomPulls(len(TOKENS))
        pool = ray.remote(HSPoolActor).options(
            max_concurrency=pool_max_concurrency(NUM_TARGETS, NUM_DRAFTERS)
        ).remote(PoolConfig(), len(TOKENS), f"bench-sched-{layout}", TracedPulls(inner))
        ray.get(pool.add_jobs.remote(jobs))
        t_start = time.time()
        t_end = t_start + dur
        for t, tg in enumerate(targets):
            pool.add_target.remote(t, tg)
        spans = ray.get([d.run.remote(pool, True, i, scale, t_end) for i, d in enumerate(drafters)])
        trace = ray.get(pool.pull_policy.remote()).trace
        ray.kill(pool)
    out = {"busy": [], "tok_s": [], "mix": [], "mix_start": []}
    for i, sp in enumerate(spans):
        b, tok = busy_and_tokens(sp, t_start + warm, t_end)
        out["busy"].append(b)
        out["tok_s"].append(tok)
        out["mix"].append(mixing(trace, i) if trace is not None else float("nan"))
        out["mix_start"].append(mixing(trace, i, True) if trace is not None else float("nan"))
    time.sleep(max(0.0, 2 * consume_cost(len(TOKENS) - 1, scale) * produce_factor()))  # targets drain
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.bench sched", description=__doc__)
    ap.add_argument("--seconds", type=float, default=9.0, help="per layout")
    ap.add_argument("--warmup", type=float, default=2.0, help="excluded from busy (the pool fills)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every sleep")
    args = ap.parse_args(argv)
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=16, include_dashboard=False, configure_logging=False, log_to_driver=False)
    factor = produce_factor()
    targets = [ray.remote(SleepTarget).remote(t, args.scale, factor) for t in range(NUM_TARGETS)]
    drafters = [ray.remote(SleepDrafter).remote() for _ in range(NUM_DRAFTERS)]
    ray.get([a.ready.remote() for a in targets + drafters])
    buckets = interleave(WEIGHTS, 4000)
    jobs = [JobSpec(i, 0, i, b, (i,), TOKENS[b], 64) for i, b in enumerate(buckets)]
    tc = mean_consume_cost(args.scale)
    print(f"job mix {WEIGHTS} over buckets of {TOKENS} tokens; drafter cost {tc * 1e3:.0f} ms/job on "
          f"average, target cost x{factor:.3f} -> targets supply {NUM_TARGETS / (tc * factor):.1f} "
          f"jobs/s vs drafters {NUM_DRAFTERS / tc:.1f} jobs/s")
    res = {}
    for layout in ("fair", "rr", "random"):
        res[layout] = r = run_layout(ray, layout, targets, drafters, jobs, args.scale, args.seconds, args.warmup)
        for i in range(NUM_DRAFTERS):
            mix = (f"mixing {r['mix'][i]:.3f} (vs non-empty at the window's start: {r['mix_start'][i]:.3f})"
                   if layout != "rr" else "mixing n/a (no shared pool)")
            print(f"{layout:6s} drafter {i}: busy {r['busy'][i]:.3f}  tokens/s {r['tok_s'][i]:8.0f}  {mix}")
    ray.shutdown()
    fair, rr, rnd = res["fair"], res["rr"], res["random"]
    print(f"fair vs rr: min busy {min(fair['busy']):.3f} vs {min(rr['busy']):.3f}; "
          f"fair vs random: mixing {min(fair['mix']):.3f} vs {min(rnd['mix']):.3f}")
    print(f"RESULT fair_busy_min={min(fair['busy']):.3f} fair_mixing={min(fair['mix']):.3f} "
          f"rr_busy_min={min(rr['busy']):.3f} random_mixing={min(rnd['mix']):.3f}")
    return 0
