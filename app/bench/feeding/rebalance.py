"""`python -m app.bench rebalance [--side drafters|targets] [--repeats R] [key=value ...]`: re-splitting on
vs off (`--sim`: the simulated shifting-balance run instead, auto against every fixed split).

Runs the real driver on conf/tiny.yaml (8 actors, 4 epochs: 136 jobs) twice in one process, once with
`topology.rebalance=off` and once with `auto` (the order alternating with `--repeats`), with injected
delays that make one side the short one whatever the machine's load: 2.3 s added to every target
forward and 2.0 s to every drafter micro-batch, against a tiny model's own 0.2-1 s and 0.4-1.9 s (quiet
to loaded 2-core box). A target's rate then stays 0.96-1.18x a drafter rank's, quiet to loaded, inside
the 0.75-1.33x band where 4/4 is the best whole split of 8 actors, so the advisor names 4/4 at any load;
`--side drafters` starts at 5/3 (drafters short: 5 targets supply 2.2 jobs/s, 3 drafters take 1.5),
`--side targets` at 3/5 (targets short: 1.3 against 2.5).

The measure is in units the load cannot move: jobs per virtual second over the last 40% of the jobs
trained (the re-split came after 30-48 jobs in the runs so far; its rebuild and the refilled buffer fall
before them), where a step of the final weights' lineage (the step log) costs what its injected delays
make it at its split: its micro-batches per rank x the drafter delay, or per target then running x the
target delay, whichever is longer (the two sides work in parallel; the split of each step is read from
its ranks, targets = actors - ranks). So it shows which split the run trained on and what that split is
worth, a re-split in the wrong direction or too late as a loss, and jobs trained twice as extra
micro-batches. The wall-clock tokens/s over the second half (first to last step row of the timeline),
which holds the re-split's pause of a minute or more, is printed beside it for context: it moves with
the machine's load, the verdict does not. Jobs trained are counted from the step log (`trained_twice`,
`never_trained`), not from the ledger, for both runs.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from app.bench.common import add_overrides, bench_config, own_cluster, print_result

TARGET_DELAY_S, DRAFTER_DELAY_S = 2.3, 2.0
WINDOW = 0.4  # the share of the jobs, the last ones, the measure covers
COMMON = ["train.epochs=4", "eval.num_prompts=2", "eval.max_new_tokens=16", "eval.every_steps=0",
          "logging.status_every_s=5", "logging.step_log=true", "checkpoint.every_steps=20",
          "topology.rebalance_hold_s=3", f"faults.target_delay_s={TARGET_DELAY_S}",
          f"faults.drafter_delay_s={DRAFTER_DELAY_S}"]
SIDES = {  # the starting split that makes this side the short one
    "drafters": ["topology.num_targets=5", "topology.num_drafters=3"],
    "targets": ["topology.num_targets=3", "topology.num_drafters=5"],
}


def virtual_rate(steps: dict[int, list[list[int]]], actors: int, target_delay_s: float, drafter_delay_s: float,
                 share: float = 0.5) -> tuple[float, int]:
    """(jobs per virtual second, jobs) over the last `share` of the micro-batches of a step-log lineage (step
    -> each rank's job ids). A step of n micro-batches on d ranks costs max(n / d x drafter delay, n / (actors
    - d) x target delay): its split's rate, whichever side bounds it, however its jobs fell on the ranks (the
    end of the data leaves steps with idle ranks wherever the re-split put the step count). A job counts
    once however often it was trained, every micro-batch costs: retraining reads as a loss."""
    order = sorted(steps)
    total = sum(len(ids) for s in order for ids in steps[s])
    done = 0
    seconds, jobs = 0.0, set()
    for s in order:
        per_rank = steps[s]
        n = sum(len(ids) for ids in per_rank)
        if done >= (1 - share) * total and n:
            targets = max(actors - len(per_rank), 1)
            seconds += max(n / len(per_rank) * drafter_delay_s, n / targets * target_delay_s)
            jobs.update(j for ids in per_rank for j in ids)
        done += n
    return (len(jobs) / seconds if seconds else 0.0), len(jobs)


def second_half_tok_s(run_dir: Path) -> float:
    """Wall-clock training tokens/s over the second half of the training phase, from the timeline's step rows."""
    from app.run.outputs.timeline import read_timeline

    rows = [r for r in read_timeline(run_dir) if r.get("k") == "step"]
    if len(rows) < 2:
        return 0.0
    t0, t1 = rows[0]["t"], rows[-1]["t"]
    mid = (t0 + t1) / 2
    tokens = sum(r["tokens"] for r in rows if r["t"] > mid)
    return tokens / (t1 - mid) if t1 > mid else 0.0


def resplits(run_dir: Path) -> list[dict]:
    """The `resplit_done` rows of a run's timeline."""
    from app.run.outputs.timeline import read_timeline

    return [r for r in read_timeline(run_dir) if r.get("k") == "resplit_done"]


def one_run(mode: str, side: str, extra: list[str], run_dir: Path) -> dict:
    from app.run.driver import run
    from app.training.step_log import FILE_NAME, count_trained, lineage

    cfg = bench_config("tiny", [*COMMON, *SIDES[side], f"topology.rebalance={mode}", f"checkpoint.dir={run_dir}",
                                *extra])
    code = run(cfg)
    assert code == 0, f"{mode} run failed with exit code {code}"
    s = json.loads((run_dir / "summary.json").read_text())
    counts = count_trained(run_dir / FILE_NAME).count(s["jobs_scheduled"], s.get("jobs_quarantined") or 0)
    actors = cfg.topology.num_targets + cfg.topology.num_drafters
    rate, jobs = virtual_rate(lineage(run_dir / FILE_NAME)[0], actors, cfg.faults.target_delay_s,
                              cfg.faults.drafter_delay_s, WINDOW)
    done = resplits(run_dir)
    return {"jobs_per_vs": rate, "window_jobs": jobs, "second_half_tok_s": second_half_tok_s(run_dir),
            "train_tok_s": s["train_tok_s"], "rebalances": s.get("rebalances", 0),
            "splits": ["/".join(map(str, r["new"])) for r in done],
            "trained_twice": counts["trained_twice"], "never_trained": counts["never_trained"]}


def simulated(jobs: int = 1200) -> int:
    """`--sim`: the shifting-balance run of app/bench/feeding/resplit_sim.py, auto vs every fixed split."""
    from app.bench.feeding.resplit_sim import compare, shifting_setup

    r = compare(shifting_setup(jobs=jobs))
    for split, secs in r["fixed_s"].items():
        print(f"fixed {split}: {secs:.1f} virtual s")
    print(f"auto from 5/3: {r['auto_s']:.1f} virtual s, re-splits "
          f"{[(round(t), old, new) for t, old, new in r['resplits']]}")
    print_result({"sim": "shifting", "jobs": jobs, "auto_s": f"{r['auto_s']:.1f}", "best_fixed": r["best_fixed"],
                  "best_fixed_s": f"{r['best_fixed_s']:.1f}", "ratio": r["auto_s"] / r["best_fixed_s"],
                  "start_fixed_s": f"{r['fixed_s']['5/3']:.1f}", "resplits": len(r["resplits"]),
                  "trained_twice": r["trained_twice"], "never_trained": r["never_trained"]})
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.bench rebalance", description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", choices=tuple(SIDES), default="drafters", help="the side made the short one")
    ap.add_argument("--repeats", type=int, default=1, help="off/auto pairs, the order alternating")
    ap.add_argument("--sim", action="store_true", help="the simulated shifting-balance run instead")
    add_overrides(ap)
    args = ap.parse_args(argv)
    if args.sim:
        return simulated()
    own_cluster()  # never another cluster on the machine; both runs share it
    results: dict[str, list[dict]] = {"off": [], "auto": []}
    for r in range(args.repeats):
        for mode in (("off", "auto") if r % 2 == 0 else ("auto", "off")):
            with tempfile.TemporaryDirectory() as tmp:
                res = one_run(mode, args.side, args.overrides, Path(tmp) / "run")
            results[mode].append(res)
            print(f"{mode}: {res['jobs_per_vs']:.3f} jobs per virtual s over the last {res['window_jobs']} jobs; "
                  f"wall clock (moves with load): {res['second_half_tok_s']:.0f} train tok/s over the second half, "
                  f"{res['train_tok_s']:.0f} over the run; re-splits {res['rebalances']} {res['splits']}, "
                  f"trained_twice={res['trained_twice']} never_trained={res['never_trained']}", flush=True)
    off = min(x["jobs_per_vs"] for x in results["off"])
    auto = min(x["jobs_per_vs"] for x in results["auto"])
    wall_off = min(x["second_half_tok_s"] for x in results["off"])
    wall_auto = min(x["second_half_tok_s"] for x in results["auto"])
    print(f"wall clock, for context only (moves with the machine's load): second-half tok/s off {wall_off:.0f}, "
          f"auto {wall_auto:.0f}, auto/off {wall_auto / wall_off if wall_off > 0 else 0.0:.3f}")
    every = [x for v in results.values() for x in v]
    print_result({"side": args.side, "repeats": args.repeats, "off_jobs_per_vs": off, "auto_jobs_per_vs": auto,
                  "ratio": auto / off if off > 0 else 0.0, "rebalances": results["auto"][0]["rebalances"],
                  "split": (results["auto"][0]["splits"] or ["none"])[-1],
                  "trained_twice": max(x["trained_twice"] for x in every),
                  "never_trained": max(x["never_trained"] for x in every)})
    return 0
