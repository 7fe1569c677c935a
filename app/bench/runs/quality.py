"""`python -m app.bench quality [--seeds 0,1,2] [--corpora markov,python] [--workers N] [key=value ...]`: what tau means.

`--target smol` measures the real target instead (SmolLM2-135M-Instruct: `app.bench.runs.quality_real`).

For each tiny corpus (`tiny.corpus`: markov, python) the bench builds (or reuses) the tiny target and
trains the DFlash drafter at one fixed budget per corpus (markov: the demo's, conf/tiny.yaml, 6 epochs;
python: `PYTHON_BUDGET`) once per seed, each seed in one process (`--workers` of them at once): the
same plan, schedule, trainer and step size (num_drafters x grad_accum jobs per optimizer step, summed
as the all-reduce sums them) as the Ray run, without the pool's timing-dependent dealing, so a seed
gives one tau. Every tau comes from `app.model.drafter_tau.measure_spec` (the run's own tau
path) on the held-out prompts, except the n-gram reference's, which replays its guesses against the
target's greedy output (`app.model.references.tau_on_greedy`, the same count for a lossless decoder).

Beside the trained drafter, on the same target and prompts:
- untrained: a fresh drafter with the seed's init (what training adds);
- ngram: longest-suffix lookup over the training responses (what a table gets without learning);
- copy shares: generated tokens whose trigram is in the prompt (copy_share) or in the prompt or earlier
  output (repeat_share): high shares mean a copier scores high here.

RESULT per corpus: tau mean, spread (max - min) and std over the seeds, each seed's tau, tau per
draft position (mean over seeds), the references, and whether the drafter beats the n-gram table.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from app.bench.common import add_overrides, bench_config, map_in_processes, result_line as format_result

# The python corpus's target needs more training than the markov chain's 200 steps to write more than
# one repeated token (LM loss 3.95 at 200 x 8, 2.37 at 1200 x 16). Its drafter is data-, depth- and
# step-limited at the demo's budget (2 layers as narrow as the target, 192 prompts: tau 1.18), so the
# python budget is 4608 prompts, 6 layers with a 512-wide MLP, 14 epochs; 32 held-out prompts, as 8 move
# tau by ~0.2. The README's quality section has the scaling. Command-line overrides still win.
PYTHON_BUDGET = ["tiny.lm_steps=1200", "tiny.lm_batch_size=16", "tiny.num_train_prompts=4608", "tiny.num_eval_prompts=32",
                 "eval.num_prompts=32", "drafter.num_layers=6", "drafter.intermediate_size=512",
                 "model.target_layer_ids=[1,2,3,4]", "train.epochs=14"]
CORPUS_OVERRIDES = {"markov": [], "python": PYTHON_BUDGET}


def corpus_config(corpus: str, seed: int, run_dir: Path, overrides: list[str] = ()):
    """conf/tiny.yaml for `corpus`, with the drafter's seeds (init, anchors, schedule) set to `seed`."""
    return bench_config("tiny", [f"tiny.corpus={corpus}", *CORPUS_OVERRIDES[corpus], f"train.seed={seed}",
                                 f"data.seed={seed}", f"pool.seed={seed}", f"checkpoint.dir={run_dir}", *overrides])


@dataclass
class Trained:
    """One in-process training run: its plan, the frozen target, the trained drafter, and its step losses."""

    plan: Any  # app.run.plan.RunPlan
    target: Any  # the HF causal LM
    drafter: Any
    head: Any
    arch: Any
    losses: list[float] = field(default_factory=list)

    def tau(self, cfg) -> tuple[float, list[float]]:
        return drafter_tau(self.plan, cfg, self.target, self.drafter, self.head, self.arch)


def train_in_process(cfg, log=lambda s: None) -> Trained:
    """The run's training in one process, each optimizer step over the jobs the group's step takes."""
    from transformers import AutoModelForCausalLM

    from app.data.target_forward import job_hidden_batch
    from app.model.build import build_or_load_drafter
    from app.model.loss import TrainBatch
    from app.run.plan import plan_run
    from app.training.trainer import DrafterTrainer

    cpu = torch.device("cpu")
    plan = plan_run(cfg, on_gpu=False, log=log, progress=False)
    target = AutoModelForCausalLM.from_pretrained(plan.model_dir, dtype=torch.float32).eval()
    drafter, head, arch = build_or_load_drafter(plan.model_dir, None, cfg.drafter, plan.layer_ids, plan.mask_token_id,
                                                cpu, torch.float32, cfg.train.seed)
    trainer = DrafterTrainer(drafter, head, cfg.drafter, cfg.train, plan.total_steps, cpu, total_jobs=len(plan.jobs))
    per_step = cfg.topology.num_drafters * cfg.train.grad_accum
    jobs, losses = list(plan.jobs), []
    for start in range(0, len(jobs), per_step):
        for job in jobs[start:start + per_step]:
            seqs = [plan.dataset.sequence(i) for i in job.seq_indices]
            with torch.no_grad():
                hb = job_hidden_batch(target, seqs, job.job_id, plan.layer_ids, cpu)
            trainer.micro_step(TrainBatch.from_hidden_batch(hb, "cpu", torch.float32), job.job_id)
        losses.append(trainer.finish_step().loss)
    return Trained(plan, target, drafter.eval(), head, arch, losses)


def spec_for(plan, cfg):
    from app.model.drafter_tau import EvalSpec, stop_token

    return EvalSpec(prompts=plan.eval_prompts, drafter=cfg.drafter, eval=cfg.eval, mask_token_id=plan.mask_token_id,
                    seed=cfg.train.seed, eos_token_id=stop_token(plan.info.eos_token_ids))


def drafter_tau(plan, cfg, target, drafter, head, arch) -> tuple[float, list[float]]:
    """(tau, per-position acceptance) of a drafter on the held-out prompts, by the run's tau path."""
    from app.model.drafter_tau import measure_spec, per_position_acceptance

    res = measure_spec(target, drafter, head, arch, spec_for(plan, cfg))
    if not res.lossless:
        raise RuntimeError("speculative output differs from greedy on an fp32 CPU target: an acceptance bug")
    return float(res.tau), per_position_acceptance(res.accepted_per_forward, arch.block_size)


def references(plan, cfg, target) -> dict:
    """The n-gram reference's tau and the copy shares of the target's greedy output (seed-independent)."""
    from app.model.spec_decode import greedy_reference
    from app.model.references import NgramDrafter, copy_shares, tau_on_greedy

    spec = spec_for(plan, cfg)
    ngram = NgramDrafter([plan.dataset.sequence(i) for i in range(len(plan.dataset))])
    forwards = tokens = total = from_prompt = from_context = 0
    for prompt in spec.prompts[: cfg.eval.num_prompts]:
        with torch.no_grad():
            greedy = greedy_reference(target, prompt, cfg.eval.max_new_tokens, spec.eos_token_id)
        per = tau_on_greedy(ngram, prompt, greedy, cfg.drafter.block_size, cfg.eval.max_new_tokens)
        forwards, tokens = forwards + len(per), tokens + sum(per)
        n, p, c = copy_shares(prompt, greedy)
        total, from_prompt, from_context = total + n, from_prompt + p, from_context + c
    return {"ngram_tau": tokens / max(forwards, 1), "copy_share": from_prompt / max(total, 1),
            "repeat_share": from_context / max(total, 1)}


@dataclass(frozen=True)
class SeedResult:
    """One seed's figures (plain values: a worker process sends it back)."""

    tau: float
    tau_pos: list[float]
    untrained_tau: float
    loss_first: float
    loss_last: float
    steps: int


def measure_seed(corpus: str, seed: int, work: Path, overrides: list[str] = ()) -> SeedResult:
    """Train one seed in this process and measure it and the seed's untrained drafter."""
    from app.model.build import build_or_load_drafter

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes; on a shared 2-core box more threads run slower
    try:
        cfg = corpus_config(corpus, seed, work / f"{corpus}-{seed}", overrides)
        run = train_in_process(cfg)
        tau, per_pos = run.tau(cfg)
        plan = run.plan
        fresh, fhead, farch = build_or_load_drafter(plan.model_dir, None, cfg.drafter, plan.layer_ids,
                                                   plan.mask_token_id, torch.device("cpu"), torch.float32, seed)
        untrained = drafter_tau(plan, cfg, run.target, fresh.eval(), fhead, farch)[0]
    finally:
        torch.set_num_threads(threads)
    return SeedResult(tau, per_pos, untrained, run.losses[0], run.losses[-1], len(run.losses))


def corpus_references(corpus: str, seed: int, work: Path, overrides: list[str] = ()) -> dict:
    """Build (or reuse) the corpus's tiny target, then its seed-independent references."""
    from transformers import AutoModelForCausalLM

    from app.run.plan import plan_run

    cfg = corpus_config(corpus, seed, work / f"{corpus}-refs", overrides)
    plan = plan_run(cfg, on_gpu=False, log=lambda s: None, progress=False)
    target = AutoModelForCausalLM.from_pretrained(plan.model_dir, dtype=torch.float32).eval()
    return references(plan, cfg, target)


def measure_corpus(corpus: str, seeds: list[int], work: Path, overrides: list[str] = (), log=print,
                   workers: int = 1) -> dict:
    """Everything RESULT prints for one corpus; `workers` > 1 trains that many seeds at once, one process each
    (every seed is single-threaded and a function of its seed alone, so the figures do not change)."""
    refs = corpus_references(corpus, seeds[0], work, overrides)  # builds the target once, before any worker
    per_seed = map_in_processes(measure_seed, [(corpus, seed, work, list(overrides)) for seed in seeds], workers)
    for seed, r in zip(seeds, per_seed):
        log(f"quality {corpus} seed {seed}: tau {r.tau:.3f} untrained {r.untrained_tau:.3f} "
            f"ngram {refs['ngram_tau']:.3f} loss {r.loss_first:.3f} -> {r.loss_last:.3f} over {r.steps} steps")
    taus = [r.tau for r in per_seed]
    mean = statistics.fmean(taus)
    return {"tau_mean": mean, "tau_spread": max(taus) - min(taus),
            "tau_std": statistics.stdev(taus) if len(taus) > 1 else 0.0, "tau_seeds": taus,
            "tau_pos": [statistics.fmean(r.tau_pos[k] for r in per_seed) for k in range(len(per_seed[0].tau_pos))],
            "untrained_tau": statistics.fmean(r.untrained_tau for r in per_seed),
            "loss_last": statistics.fmean(r.loss_last for r in per_seed), **refs,
            "beats_ngram": mean > refs["ngram_tau"]}


def result_line(results: dict[str, dict]) -> str:
    fields: dict[str, object] = {}
    for corpus, r in results.items():
        fields.update({f"{corpus}_{k}": r[k] for k in ("tau_mean", "tau_spread", "tau_std")})
        fields[f"{corpus}_tau_seeds"] = "/".join(f"{t:.3f}" for t in r["tau_seeds"])
        fields[f"{corpus}_tau_pos"] = "/".join(f"{p:.2f}" for p in r["tau_pos"])
        fields.update({f"{corpus}_{k}": r[k] for k in ("ngram_tau", "untrained_tau", "loss_last", "copy_share",
                                                        "repeat_share", "beats_ngram")})
    return format_result(fields)


def split_target(argv: list[str]) -> tuple[str, list[str]]:
    """(`--target` value, the other arguments): tiny (the tiny corpora, this module) or smol (the real
    SmolLM2 target, `app.bench.runs.quality_real`)."""
    rest, target, i = [], "tiny", 0
    while i < len(argv):
        if argv[i] == "--target" and i + 1 < len(argv):
            target, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith("--target="):
            target = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    if target not in ("tiny", "smol"):
        raise SystemExit(f"--target {target}: give tiny (the tiny corpora) or smol (SmolLM2-135M-Instruct)")
    return target, rest


def main(argv: list[str]) -> int:
    target, argv = split_target(list(argv))
    if target == "smol":
        from app.bench.runs.quality_real import main as real_main

        return real_main(argv)
    ap = argparse.ArgumentParser(prog="python -m app.bench quality", description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2", help="drafter seeds (train, data, pool), comma-separated")
    ap.add_argument("--corpora", default="markov,python", help="tiny corpora, comma-separated")
    ap.add_argument("--workers", type=int, default=0,
                    help="seeds trained at once, one single-threaded process each; 0 = every seed at once")
    add_overrides(ap, "train.epochs=6")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    torch.set_num_threads(1)  # tiny shapes; on a shared 2-core box more threads run slower
    if args.workers < 0:
        raise SystemExit(f"--workers {args.workers}: give 0 (every seed at once) or a count")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as tmp:
        for corpus in args.corpora.split(","):
            results[corpus] = measure_corpus(corpus, seeds, Path(tmp), args.overrides,
                                             workers=args.workers or len(seeds))
    print(result_line(results))
    if "python" in results and not results["python"]["beats_ngram"]:
        print("WARNING: the DFlash drafter does not beat the n-gram reference on the python corpus")
        return 1
    return 0
