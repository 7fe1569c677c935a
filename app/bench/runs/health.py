"""`python -m app.bench health [--rounds N] [key=value ...]`: what the learning checks add to an evaluation.

Trains the markov demo's drafter in this process (conf/tiny.yaml, seed 0: `app.bench.runs.quality.train_in_process`,
about 30 s of one CPU), then times the run's own evaluation (`app.model.drafter_tau.evaluate_drafter`: the drafter
built from rank 0's weights, tau decoded on the held-out prompts) with and without the checks
(app/model/health.py), alternately, `--rounds` times each, side by side in this one process. The greedy outputs and
the checks' target features are cached first, as a target keeps them after a run's first evaluation (every later one
reuses them), so both sides time what an evaluation during the run costs. RESULT: the median wall and CPU seconds of each side (one thread: on a shared
box the wall clock also counts other processes' turns), their ratios, the checks' own seconds and their figures.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from app.bench.common import add_overrides, print_result


def main(argv: list[str]) -> int:
    from app.bench.runs.quality import corpus_config, train_in_process
    from app.model.health import FeatureCache
    from app.model.drafter_tau import evaluate_drafter, stop_token, weights_to_numpy
    from app.run.evaluate.schedule import eval_spec

    ap = argparse.ArgumentParser(prog="python -m app.bench health", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="evaluations timed on each side, alternately")
    add_overrides(ap, "train.epochs=6")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # tiny shapes; on a shared 2-core box more threads run slower
    with tempfile.TemporaryDirectory(prefix="bench-health-") as tmp:
        cfg = corpus_config("markov", 0, Path(tmp) / "run", args.overrides)
        run = train_in_process(cfg)
    plan, cpu = run.plan, torch.device("cpu")
    checked = eval_spec(plan, stop_token(plan.info.eos_token_ids))  # the run's own spec, training sample included
    plain = replace(checked, health=None, fit=())
    weights, references, features = weights_to_numpy(run.drafter), {}, FeatureCache()

    def one(spec) -> tuple[float, float, dict]:
        t0, c0 = time.perf_counter(), time.process_time()
        result, _, _ = evaluate_drafter(run.target, plan.model_dir, plan.layer_ids, len(run.losses), weights, spec,
                                        cpu, torch.float32, references, features)
        return time.perf_counter() - t0, time.process_time() - c0, result.to_dict()

    one(checked)  # caches the greedy outputs and the checks' target features, as a run's first evaluation does
    plain_s, checked_s, plain_cpu, checked_cpu, health_s, health = [], [], [], [], [], None
    for _ in range(args.rounds):
        wall, cpu_s, _ = one(plain)
        plain_s.append(wall), plain_cpu.append(cpu_s)
        wall, cpu_s, result = one(checked)
        checked_s.append(wall), checked_cpu.append(cpu_s)
        health = result["health"]
        health_s.append(health["seconds"])
    base, with_checks = statistics.median(plain_s), statistics.median(checked_s)
    # CPU seconds too (one thread): on a shared box the wall clock also counts the other processes' turns.
    base_cpu, with_checks_cpu = statistics.median(plain_cpu), statistics.median(checked_cpu)
    print(f"health: evaluation {base:.2f} s without the checks, {with_checks:.2f} s with them "
          f"({with_checks / base:.2f}x; CPU seconds {base_cpu:.2f} vs {with_checks_cpu:.2f}: "
          f"{with_checks_cpu / base_cpu:.2f}x); the checks alone {statistics.median(health_s):.2f} s; {health['status']}")
    for line in health["verdicts"]:
        print(f"health: {line}")
    print_result({"eval_s": base, "eval_with_checks_s": with_checks, "ratio": with_checks / base,
                  "eval_cpu_s": base_cpu, "eval_with_checks_cpu_s": with_checks_cpu, "cpu_ratio": with_checks_cpu / base_cpu,
                  "checks_s": statistics.median(health_s), "rounds": args.rounds, "steps": len(run.losses),
                  "tau": health["tau"], "tau_fit": health["tau_fit"], "tau_no_features": health["tau_no_features"],
                  "first_distinct": health["first_distinct"], "first_top_share": health["first_top_share"],
                  "anchor_changed": health["anchor_changed"], "pos1": health["pos1"], "status": health["status"]})
    return 0
