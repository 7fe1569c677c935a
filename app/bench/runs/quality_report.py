"""The RESULT lines of `python -m app.bench quality --target smol`: one per drafter and reference, the training
curve and the margin. Every figure is a mean over the seeds that measured it; `tau_seeds` lists each seed's."""
from __future__ import annotations

import statistics

from app.bench.common import print_result

GOAL = 0.5  # the trained drafter must beat the best training-free reference by this much tau (mean over seeds)
DRAFTERS = ("dflash", "untrained", "zero_features", "hybrid")  # per seed (the hybrid drafts with the seed's drafter)
FREE = ("bigram", "ngram", "prompt_lookup")  # training-free: the same for every seed
FIGURES = ("tau_train", "pos1", "pos1_train", "anchor_sensitivity", "first_top_share", "cpu_min", "steps")


def _stats(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _joined(vals, d: int = 3) -> str:
    return "/".join(f"{v:.{d}f}" for v in vals)


def features_buy(per_seed: list[dict]) -> float:
    """Mean over the seeds with both drafters of tau(trained) - tau(trained with zeroed features)."""
    both = [r["dflash"]["tau"] - r["zero_features"]["tau"] for r in per_seed if "zero_features" in r]
    return statistics.fmean(both) if both else float("nan")


def proposer_line(name: str, runs: list[dict], seeds: list[int]) -> float:
    """One RESULT line for `name` over its runs (one per seed that has it); returns the mean tau."""
    taus = [r["tau"] for r in runs]
    mean, std = _stats(taus)
    pos = [statistics.fmean(r["tau_pos"][k] for r in runs) for k in range(len(runs[0]["tau_pos"]))]
    extra = [(k, statistics.fmean(r[k] for r in runs)) for k in FIGURES if all(k in r for r in runs)]
    block = [("block", runs[0]["block"])] if "block" in runs[0] else []  # the block it drafted in
    print_result([("bench", "quality_smol"), ("drafter", name), ("seeds", "/".join(map(str, seeds))), *block,
                  ("tau_seeds", _joined(taus)), ("tau_mean", mean), ("tau_std", std), *extra,
                  ("tau_pos", _joined(pos, 2))])
    return mean


def report(seeds: list[int], per_seed: list[dict], free: dict, seconds: float) -> dict:
    """Every RESULT line; returns the mean tau of each proposer."""
    means = {}
    for name in DRAFTERS:
        have = [(s, r[name]) for s, r in zip(seeds, per_seed) if name in r]
        if have:
            means[name] = proposer_line(name, [r for _, r in have], [s for s, _ in have])
    for name in FREE:
        if name in free:
            means[name] = proposer_line(name, [free[name]] * len(seeds), seeds)
    curve = per_seed[0]["dflash"]["curve"]
    print_result([("bench", "quality_smol_curve"), ("seed", seeds[0]),
                  *[(k, "/".join(f"{p[k]:.1f}" if k == "cpu_min" else str(p[k]) if k != "tau" and k != "tau_train"
                                  else f"{p[k]:.3f}" for p in curve)) for k in ("steps", "cpu_min", "tau", "tau_train")]])
    best = max((k for k in FREE if k in means), key=lambda k: means[k])
    margin = means["dflash"] - means[best]
    fit = statistics.fmean(r["dflash"]["tau_train"] - r["dflash"]["tau"] for r in per_seed)
    print_result([("bench", "quality_smol_margin"), ("best_reference", best), ("margin", margin),
                  ("features_buy", features_buy(per_seed)), ("fit_gap", fit),
                  ("hybrid_vs_lookup", means.get("hybrid", float("nan")) - means.get("prompt_lookup", float("nan"))),
                  ("goal", GOAL), ("met", margin >= GOAL), ("seconds", seconds)])
    if margin < GOAL:
        print(f"WARNING: the trained drafter beats {best} by {margin:.3f} tau, short of the {GOAL} goal; "
              "see quality_smol_curve for tau against steps and CPU minutes")
    return means
