"""`python -m app.bench rebalance [--side targets|drafters] [--repeats R] [key=value ...]`: re-splitting on
vs off (`--sim`: the simulated shifting-balance run instead, auto against every fixed split).

Runs the real driver on conf/tiny.yaml (5 targets / 3 drafters) twice in one process, with an injected
per-job delay that makes one side the short one by 2:1 (`--side drafters`, default: the drafters'
capacity is half the targets'; `--side targets`: the reverse), once with `topology.rebalance=off` and
once with `auto`, the order alternating with `--repeats`. The measure is the training tokens/s over
the second half of each run's training (first to last step row of its timeline), where the re-split,
if any, has been carried out. Jobs trained are counted from the step log (`trained_twice`,
`never_trained`), not from the ledger, for both runs.

The imbalance, on this project's 2-core CPU box under load: a tiny forward takes ~0.2 s and a drafter
micro-batch ~0.4 s. With 0.8 s added to each, a target makes a job per ~1.0 s and a drafter rank
trains one per ~1.2 s: 5 targets supply 5 jobs/s, 3 drafters take 2.5 (2:1); the advisor names 4/4
(+33% estimated, the best whole split). `--side targets`: 2.0 s per forward and 0.25 s per micro-batch,
5 targets supply ~2.3 jobs/s, 3 drafters take ~4.6 (1:2); the advisor names 6/2 or 7/1.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
COMMON = ["train.epochs=6", "eval.num_prompts=2", "eval.max_new_tokens=16", "eval.every_steps=0",
          "logging.status_every_s=5", "logging.step_log=true", "checkpoint.every_steps=20",
          "topology.rebalance_hold_s=3"]
SIDES = {  # the short side's delay is the one that makes the 2:1 imbalance
    "drafters": ["faults.target_delay_s=0.8", "faults.drafter_delay_s=0.8"],
    "targets": ["faults.target_delay_s=2.0", "faults.drafter_delay_s=0.25"],
}


def second_half_tok_s(run_dir: Path) -> float:
    """Training tokens/s over the second half of the training phase, from the timeline's step rows."""
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
    from app.config.load import load_config
    from app.run.driver import run
    from app.training.step_log import FILE_NAME, count_trained

    cfg = load_config(ROOT / "conf/tiny.yaml", [*COMMON, *SIDES[side], f"topology.rebalance={mode}",
                                                 f"checkpoint.dir={run_dir}", *extra])
    code = run(cfg)
    assert code == 0, f"{mode} run failed with exit code {code}"
    s = json.loads((run_dir / "summary.json").read_text())
    counts = count_trained(run_dir / FILE_NAME).count(s["jobs_scheduled"], s.get("jobs_quarantined") or 0)
    return {"second_half_tok_s": second_half_tok_s(run_dir), "train_tok_s": s["train_tok_s"],
            "rebalances": s.get("rebalances", 0), "splits": [r["new"] for r in resplits(run_dir)],
            "trained_twice": counts["trained_twice"], "never_trained": counts["never_trained"]}


def simulated(jobs: int = 1200) -> int:
    """`--sim`: the shifting-balance run of app/bench/feeding/resplit_sim.py, auto vs every fixed split."""
    from app.bench.feeding.resplit_sim import compare, shifting_setup

    r = compare(shifting_setup(jobs=jobs))
    for split, secs in r["fixed_s"].items():
        print(f"fixed {split}: {secs:.1f} virtual s")
    print(f"auto from 5/3: {r['auto_s']:.1f} virtual s, re-splits "
          f"{[(round(t), old, new) for t, old, new in r['resplits']]}")
    print(f"RESULT sim=shifting jobs={jobs} auto_s={r['auto_s']:.1f} best_fixed={r['best_fixed']} "
          f"best_fixed_s={r['best_fixed_s']:.1f} ratio={r['auto_s'] / r['best_fixed_s']:.3f} "
          f"start_fixed_s={r['fixed_s']['5/3']:.1f} resplits={len(r['resplits'])} trained_twice={r['trained_twice']} "
          f"never_trained={r['never_trained']}")
    return 0


def main(argv: list[str]) -> int:
    if "--sim" in argv:
        return simulated()
    side, repeats, rest = "drafters", 1, list(argv)
    if "--side" in rest:
        i = rest.index("--side")
        side, rest = rest[i + 1], rest[:i] + rest[i + 2:]
    if "--repeats" in rest:
        i = rest.index("--repeats")
        repeats, rest = int(rest[i + 1]), rest[:i] + rest[i + 2:]
    if side not in SIDES:
        raise ValueError(f"--side {side!r}: choose targets or drafters (the side made short by 2:1)")
    import os

    from app.ray_cluster import start_own_cluster

    start_own_cluster(num_cpus=max(os.cpu_count() or 1, 8))  # never another cluster on the machine; both runs share it
    results: dict[str, list[dict]] = {"off": [], "auto": []}
    for r in range(repeats):
        for mode in (("off", "auto") if r % 2 == 0 else ("auto", "off")):
            with tempfile.TemporaryDirectory() as tmp:
                res = one_run(mode, side, rest, Path(tmp) / "run")
            results[mode].append(res)
            print(f"{mode}: {res['second_half_tok_s']:.0f} train tok/s over the second half "
                  f"({res['train_tok_s']:.0f} over the run), re-splits {res['rebalances']} {res['splits']}, "
                  f"trained_twice={res['trained_twice']} never_trained={res['never_trained']}", flush=True)
    off = min(x["second_half_tok_s"] for x in results["off"])
    auto = min(x["second_half_tok_s"] for x in results["auto"])
    twice = max(x["trained_twice"] for v in results.values() for x in v)
    never = max(x["never_trained"] for v in results.values() for x in v)
    print(f"RESULT side={side} repeats={repeats} off_tok_s={off:.1f} auto_tok_s={auto:.1f} "
          f"ratio={auto / off if off > 0 else 0.0:.3f} rebalances={results['auto'][0]['rebalances']} "
          f"trained_twice={twice} never_trained={never}")
    return 0
