"""`python -m app.prepare --config FILE --out DIR [key=value ...]`: check the data before a run.

Tokenizes, filters, buckets and schedules exactly as a training run would, and writes
- DIR/summary.json: records read, kept and dropped by reason (per file and in total, accounting for
  every record), tokens, per-bucket sequences/tokens/jobs, jobs per epoch and padding efficiency;
- DIR/schedule.jsonl: one line per job of every epoch (epoch, index, job_id, bucket, sequences,
  padded tokens).
The output is deterministic: running it twice gives byte-identical files. The tokenized data goes to
the same cache a run reads (`data.cache_dir`, default `<checkpoint.dir>/data-cache`), so a run with the
same config afterwards loads it instead of tokenizing again.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from app.config.schema import Config


def run_prepare(cfg: Config, out_dir: str | Path, *, progress: bool = True, log=print) -> dict:
    """Tokenize (or load from the data cache, which this fills for the run) and schedule per `cfg`;
    write summary.json and schedule.jsonl; return the summary."""
    from transformers import AutoTokenizer

    from app.config.checks import read_target_info
    from app.data.pipeline import load_or_tokenize
    from app.data.schedule import epoch_jobs, schedule_summary
    from app.tiny.build import resolve_target

    target = resolve_target(cfg)
    tokenizer = AutoTokenizer.from_pretrained(target.model_dir)
    dataset = load_or_tokenize(cfg, target.model_dir, tokenizer, target.train_files, progress=progress, log=log,
                               vocab_size=read_target_info(target.model_dir).vocab_size)
    lengths = dataset.lengths()
    schedules = [epoch_jobs(lengths, cfg.data, epoch) for epoch in range(cfg.train.epochs)]  # compact arrays

    data_summary = dataset.summary.to_dict()
    total = data_summary["total"]
    summary = {
        "target": cfg.model.target,
        "model_dir": target.model_dir,
        "train_files": list(target.train_files),
        "mask_token_id": target.mask_token_id,
        "settings": {
            "format": cfg.data.format,
            "max_length": cfg.data.max_length,
            "overlong": cfg.data.overlong,
            "min_loss_tokens": 2 * cfg.drafter.block_size,
            "bucket_boundaries": list(cfg.data.bucket_boundaries),
            "tokens_per_job": cfg.data.tokens_per_job,
            "seed": cfg.data.seed,
            "epochs": cfg.train.epochs,
        },
        "records": total["records"],
        "kept": total["kept"],
        "dropped": total["dropped"],
        "truncated": total["truncated"],
        "accounted": total["kept"] + sum(total["dropped"].values()) == total["records"],
        "tokens": total["tokens"],
        "loss_tokens": total["loss_tokens"],
        "files": data_summary["files"],
        **schedule_summary(lengths, cfg.data, cfg.train.epochs, schedules=schedules),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    with open(out / "schedule.jsonl", "w") as f:
        for jobs in schedules:
            for s in jobs.specs():  # one epoch's JobSpecs at a time
                row = {
                    "epoch": s.epoch,
                    "index": s.index,
                    "job_id": s.job_id,
                    "bucket": s.bucket,
                    "sequences": list(s.seq_indices),
                    "padded_tokens": s.padded_tokens,
                    "tokens": int(lengths[list(s.seq_indices)].sum()),
                }
                f.write(json.dumps(row) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.prepare", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML file, e.g. conf/tiny.yaml")
    parser.add_argument("--out", required=True, help="folder for summary.json and schedule.jsonl")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. data.max_length=2048")
    args = parser.parse_args(argv)

    from app.config.errors import UserError
    from app.config.load import load_config

    t0 = time.perf_counter()
    try:
        s = run_prepare(load_config(args.config, args.overrides), args.out)
    except UserError as exc:  # ConfigError, DataError: one line, exit 2
        print(f"{exc.kind} error: {exc}", file=sys.stderr)
        return 2
    print(
        f"records={s['records']} kept={s['kept']} dropped={s['dropped']} truncated={s['truncated']} "
        f"tokens={s['tokens']} loss_tokens={s['loss_tokens']} jobs_per_epoch={s['jobs_per_epoch']} "
        f"-> {args.out}/summary.json, {args.out}/schedule.jsonl ({time.perf_counter() - t0:.1f}s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
