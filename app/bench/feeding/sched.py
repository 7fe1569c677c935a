"""`python -m app.bench sched`: does each step mix the buckets as the data does, does a bucket pile up,
do the drafters stay fed? Four layouts on the same sleeping actors (app/bench/feeding/sleepers.py), same
schedule, one run each:
  stratified: the HSPoolActor with its default pull policy (each bucket at its own rate);
  rr:         the HSPoolActor with per-drafter round-robin over non-empty buckets;
  random:     the HSPoolActor with uniformly random pulls over buffered items;
  queue:      one ray.util.queue.Queue per drafter, targets assigned round-robin (t -> t % 3), the
              seed's original layout.
5 targets produce the schedule (app/data/schedule.py's interleave of the mix) and 3 drafter ranks
consume it in lockstep, running the drafter's own step protocol (app/training/loop.py, as
actors/drafter.py does) with a sleep of the item's cost for compute: each prefetches its next pull,
steps every 4 items (or on Drained), meets the other ranks at a barrier actor (the all-reduce, then
the all-gather), and acks on its next pull (at once while a pull still waits). Item costs by bucket
span 50-300 ms (short buckets cost the drafter most, as query rows do), targets supply 10% more than
the drafters eat.

Measures (app/pool/telemetry.py, the same for every layout): step_tv (mean TV distance of each global
step's bucket mix from the data's shares), step_tv_floor (the schedule's own order cut into steps),
backlog (time-averaged share of the buffer held by its largest bucket, buffer = landed but not yet
pulled, from the targets' and drafters' own timestamps), tail_single (share of the last 15% of
steps drawn from one bucket), busy_min (least fed rank: 1 - its share of time blocked waiting for an
item; waiting at the barrier for a slower rank is not data starvation and is reported as
`barrier_idle`, the rank balance that issue 17's dealing addresses). busy and backlog cover the
window from --warmup seconds to the last job produced.

`--fast` scales costs to 20-80 ms (the pull round trip matters more); `--sim` runs the same setups
in the discrete-event simulation (app/bench/feeding/simulate.py: the same protocol on a virtual clock)
instead of Ray, in seconds.
"""
from __future__ import annotations

import argparse
import time

from app.bench.common import own_cluster, print_result
from app.bench.feeding.sleepers import ACCUM, NUM_DRAFTERS, NUM_TARGETS, Barrier, SleepDrafter, SleepTarget
from app.config.schema import PoolConfig
from app.messages import EndOfStream, JobSpec
from app.pool.stream import RunShape
from app.pool.telemetry import BacklogMeter, bucket_counts, shares_of, step_tv, step_tv_floor, tail_single

DRAFTER_COST = [0.30, 0.25, 0.20, 0.15, 0.10, 0.05]  # s per item by bucket (short sequences: more rows)
FAST_COST = [0.080, 0.068, 0.056, 0.044, 0.032, 0.020]  # --fast: 20-80 ms
MIXES = {  # jobs per bucket: conf/tiny.yaml's own mix (the longest bucket dominates) and a middle-heavy one
    "long": [1, 4, 5, 6, 7, 11],
    "middle": [3, 5, 10, 6, 4, 3],
}
SUPPLY = 1.10
LAYOUTS = ("stratified", "rr", "random", "queue")


def costs(mix: list[int], scale: float, fast: bool = False) -> tuple[list[float], list[float]]:
    """(drafter cost, target cost) per bucket: targets out-supply the drafters' nominal rate by 10%,
    a job of a longer bucket costs the target a little more (attention)."""
    drafter = [c * scale for c in (FAST_COST if fast else DRAFTER_COST)]
    mean = sum(m * c for m, c in zip(mix, drafter)) / sum(mix)
    shape = [0.7 + 0.12 * b for b in range(6)]
    mean_shape = sum(m * s for m, s in zip(mix, shape)) / sum(mix)
    per_job = NUM_TARGETS * mean / (NUM_DRAFTERS * SUPPLY)
    return drafter, [per_job * s / mean_shape for s in shape]


def run_layout(ray, layout: str, targets, drafters, jobs: list[JobSpec], dcost: list[float]) -> dict:
    from actors.hs_pool import HSPoolActor, pool_max_concurrency

    barrier = ray.remote(Barrier).remote(NUM_DRAFTERS)
    t0 = time.time()
    if layout == "queue":
        from ray.util.queue import Queue

        queues = [Queue(maxsize=PoolConfig().capacity // NUM_DRAFTERS) for _ in range(NUM_DRAFTERS)]
        [q.size() for q in queues]
        t0 = time.time()
        prods = {t: tg.produce.remote(queues[t % NUM_DRAFTERS], jobs[t::NUM_TARGETS]) for t, tg in enumerate(targets)}
        runs = [d.run.remote(queues[i], False, i, dcost, barrier) for i, d in enumerate(drafters)]
        open_q = {q: [t for t in prods if t % NUM_DRAFTERS == q] for q in range(NUM_DRAFTERS)}
        while open_q:  # a queue's stream ends when every target feeding it is done
            for q, ts in list(open_q.items()):
                if all(ray.wait([prods[t]], timeout=0)[0] for t in ts):
                    queues[q].put(EndOfStream())
                    del open_q[q]
            time.sleep(0.05)
        out = ray.get(runs)
        for q in queues:
            q.shutdown()
        pool_stats = None
    else:
        from app.bench.feeding.pull_policies import RandomPulls

        policy = {"stratified": None, "rr": "round_robin", "random": RandomPulls(6)}[layout]
        pool = ray.remote(HSPoolActor).options(
            max_concurrency=pool_max_concurrency(NUM_TARGETS, NUM_DRAFTERS)
        ).remote(PoolConfig(), 6, f"bench-sched-{layout}", policy, runs={"": RunShape(NUM_DRAFTERS, ACCUM)})
        ray.get(pool.add_jobs.remote(jobs))
        ray.get(pool.finish_adding.remote())
        t0 = time.time()
        for t, tg in enumerate(targets):
            pool.add_target.remote(t, tg)
        out = ray.get([d.run.remote(pool, True, i, dcost, barrier) for i, d in enumerate(drafters)])
        pool_stats = ray.get(pool.stats.remote())
        ray.kill(pool)
    landed = [e for tg in targets for e in ray.get(tg.take_log.remote())]
    ray.kill(barrier)
    return {"t0": t0, "drafters": out, "landed": landed, "pool_stats": pool_stats}


def measure(raw: dict, schedule: list[int], warmup: float) -> dict:
    shares = shares_of(bucket_counts(schedule, 6))
    by_step: dict[int, list[int]] = {}
    for d in raw["drafters"]:
        for step, _jid, b, _t in d["items"]:
            by_step.setdefault(step, []).append(b)
    steps = [bucket_counts(by_step[s], 6) for s in sorted(by_step)]
    t_lo = raw["t0"] + warmup
    t_hi = max(t for _, _, t in raw["landed"])
    events = sorted([(t, b, +1) for _, b, t in raw["landed"]] +
                    [(t, b, -1) for d in raw["drafters"] for _, _, b, t in d["items"]])
    meter, counts = BacklogMeter(), [0] * 6
    for t, b, delta in events:
        counts[b] += delta
        meter.update(t, [max(0, c) for c in counts], t_lo <= t < t_hi)
    window = t_hi - t_lo
    busy = []
    for d in raw["drafters"]:
        waited = sum(max(0.0, min(b, t_hi) - max(a, t_lo)) for a, b in d["waits"])
        busy.append(1.0 - waited / window)
    return {"step_tv": step_tv(steps, shares), "backlog": meter.value(), "tail_single": tail_single(steps),
            "busy_min": min(busy), "busy": busy, "steps": len(steps), "window_s": window,
            "pool_backlog": raw["pool_stats"].backlog_share if raw["pool_stats"] else float("nan")}


def run_sim(mix: list[int], jobs: int, dcost: list[float], tcost: list[float], warmup: float) -> dict:
    from app.bench.feeding.pull_policies import RandomPulls
    from app.bench.feeding.simulate import SimSetup, simulate

    setup = SimSetup(mix, jobs, dcost, tcost, NUM_DRAFTERS, ACCUM, NUM_TARGETS, warmup=warmup)
    out = {}
    for layout, pol in (("stratified", None), ("rr", "round_robin"), ("random", RandomPulls(6))):
        r = simulate(setup, pol)
        m = r.measures()
        out[layout] = m | {"busy": r.busy, "steps": len(r.steps), "window_s": r.t_produced - warmup,
                           "pool_backlog": r.pool_stats.backlog_share}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.bench sched", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=0, help="jobs per layout (default: 600; 1200 with --fast)")
    ap.add_argument("--fast", action="store_true", help="item costs of 20-80 ms instead of 50-300 ms")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every cost (a slow box: say so)")
    ap.add_argument("--warmup", type=float, default=0.0, help="seconds left out of busy and backlog (default 2, 1 fast)")
    ap.add_argument("--mixes", default="", help="comma list of " + ",".join(MIXES) + " (default: all; --fast: long)")
    ap.add_argument("--sim", action="store_true", help="discrete-event simulation instead of Ray (no queue layout)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    scale = args.scale
    jobs_n = args.jobs or (1200 if args.fast else 600)
    warmup = args.warmup or (1.0 if args.fast else 2.0)
    mixes = [m for m in (args.mixes or ("long" if args.fast else ",".join(MIXES))).split(",") if m]
    from app.bench.feeding.simulate import schedule_of

    res: dict[str, dict] = {}
    ray = None
    if not args.sim:
        import sys

        from app.bench.feeding import sleepers

        ray = own_cluster(16)  # never another cluster on the machine (RAY_ADDRESS, ray start)
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        ray.cloudpickle.register_pickle_by_value(sleepers)
        drafters = [ray.remote(SleepDrafter).options(max_concurrency=2).remote() for _ in range(NUM_DRAFTERS)]
    for mix_name in mixes:
        mix = MIXES[mix_name]
        dcost, tcost = costs(mix, scale, args.fast)
        schedule = schedule_of(mix, jobs_n)
        jobs = [JobSpec(i, 0, i, b, (i,), 64, 64) for i, b in enumerate(schedule)]
        floor = step_tv_floor(schedule, NUM_DRAFTERS * ACCUM, 6)
        print(f"mix {mix_name} {mix}: {jobs_n} jobs, drafter {min(dcost) * 1e3:.0f}-{max(dcost) * 1e3:.0f} ms/item, "
              f"targets {min(tcost) * 1e3:.0f}-{max(tcost) * 1e3:.0f} ms/job ({SUPPLY:.2f}x supply), "
              f"{NUM_TARGETS} targets, {NUM_DRAFTERS} ranks x {ACCUM} accum, step_tv_floor {floor:.3f}")
        if args.sim:
            got = run_sim(mix, jobs_n, dcost, tcost, warmup)
        else:
            got = {}
            for layout in LAYOUTS:
                targets = [ray.remote(SleepTarget).remote(t, tcost, args.seed * 100 + t) for t in range(NUM_TARGETS)]
                ray.get([a.ready.remote() for a in targets + drafters])
                got[layout] = measure(run_layout(ray, layout, targets, drafters, jobs, dcost), schedule, warmup)
                for a in targets:
                    ray.kill(a)
        for layout, m in got.items():
            m["step_tv_floor"] = floor
            print(f"  {layout:10s} step_tv {m['step_tv']:.3f} (floor {floor:.3f})  backlog {m['backlog']:.3f}  "
                  f"tail_single {m['tail_single']:.3f}  busy_min {m['busy_min']:.3f}  "
                  f"busy {' '.join(f'{b:.3f}' for b in m['busy'])}  steps {m['steps']}  window {m['window_s']:.0f} s"
                  + (f"  (pool's own backlog {m['pool_backlog']:.3f})" if m['pool_backlog'] == m['pool_backlog'] else ""))
        res[mix_name] = got
    if ray is not None:
        ray.shutdown()
    r = res[mixes[0]]
    s = r["stratified"]
    q = r.get("queue", {"busy_min": float("nan")})
    print_result({"step_tv": s["step_tv"], "step_tv_floor": s["step_tv_floor"], "backlog": s["backlog"],
                  "tail_single": s["tail_single"], "busy_min": s["busy_min"], "rr_step_tv": r["rr"]["step_tv"],
                  "rr_backlog": r["rr"]["backlog"], "random_step_tv": r["random"]["step_tv"],
                  "queue_busy_min": q["busy_min"]})
    return 0
