"""`python -m app.train --config FILE [key=value ...]`: the driver.

    conf/*.yaml ─► config (validated) ─► target resolved, data tokenized, jobs scheduled (no Ray yet)
                                              │
          Ray: one placement group, a bundle per actor (targets first, then drafters)
                                              ▼
         TargetActor x N ◄── forward(job) ── HSPoolActor ── pull / ack ──► DrafterActor x M (DDP)
         (frozen LM)     ── (meta, hidden) ─► (queue, buckets,            (grad-accum, all-reduce,
                                               leases, ledger, metrics)     step, ack, checkpoint)
                                              │
          driver: status line + wandb, restarts, watchdog, SIGTERM -> checkpoint -> exit 0,
                  final export, tau (untrained vs trained), summary.json + RESULT line

Exit codes: 0 finished or stopped cleanly, 1 the run failed (one line says why), 2 bad config or data
(one line, before Ray starts where the check does not need the cluster).
"""
from __future__ import annotations

import argparse
import sys

from app.config.errors import UserError
from app.config.load import load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.train", description="Train a DFlash drafter on Ray.")
    parser.add_argument("--config", required=True, help="YAML file, e.g. conf/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.lr=1e-3")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except UserError as exc:
        print(f"{exc.kind} error: {exc}", file=sys.stderr)
        return 2
    from app.run.driver import run  # heavy imports (ray, torch) only once the config is known good

    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
