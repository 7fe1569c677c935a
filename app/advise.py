"""`python -m app.advise RUN_DIR`: the target/drafter split advice for a finished (or running) run.

RUN_DIR is the run's `checkpoint.dir`. The advice is recomputed from `RUN_DIR/timeline.jsonl` (the
same numbers the status line used: tokens/s per target while computing, per drafter rank while
computing); see `app/run/elastic/advisor.py` for the model behind it.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterable

from app.run.elastic.advisor import SplitAdvice, SplitAdvisor


def advise_from_timeline(rows: Iterable[dict], header: dict | None = None) -> SplitAdvice | None:
    """The advice for a finished run from its timeline rows (see app/run/outputs/timeline.py).

    A run that was resumed has one `run` header per start; each start has a fresh pool, so target
    counters add up over starts (the last pool snapshot of each), step records over all of them.
    `rows` may be a stream read once (a long run's file) when `header`, the last `run` row, is given;
    without it `rows` must be a list, searched backwards for that header.
    """
    if header is None:
        rows = list(rows)
        header = next((r for r in reversed(rows) if r.get("k") == "run"), None)
    if header is None:
        return None
    advisor = SplitAdvisor(header["num_targets"], header["num_drafters"], header.get("gpus_per_target", 1.0),
                           header.get("gpus_per_drafter", 1.0))
    totals: dict[str, dict[int, float]] = {"tokens_by_target": {}, "forward_s_by_target": {}, "done_by_target": {}}
    last_pool: dict | None = None
    for row in itertools.chain(rows, [{"k": "run"}]):  # a sentinel header flushes the last start's pool counters
        if row.get("k") == "run" and last_pool is not None:
            for key, acc in totals.items():
                for tid, v in last_pool[key].items():
                    acc[int(tid)] = acc.get(int(tid), 0) + v
            last_pool = None
        elif row.get("k") == "pool":
            last_pool = row
        elif row.get("k") == "step":
            advisor.add_records([row])
        elif row.get("k") == "resplit_done":  # the run changed its split: the drafter ranks count afresh
            advisor.resplit(*row["new"])
    advisor.add_pool(totals)
    return advisor.estimate(stable=advisor.enough_samples())


def main(argv: list[str] | None = None) -> int:
    from app.run.outputs.timeline import FILE_NAME, iter_timeline

    p = argparse.ArgumentParser(prog="python -m app.advise", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="the run's checkpoint.dir")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    # Two streamed passes (the last start's header, then the rows it needs): a long run's timeline is
    # GiBs of step rows, never held in memory at once.
    header = None
    for header in iter_timeline(args.run_dir, kinds=("run",)):
        pass
    if header is None:
        print(f"error: no {FILE_NAME} in {args.run_dir}; give the checkpoint.dir of a run started by this "
              "version of python -m app.train", file=sys.stderr)
        return 2
    advice = advise_from_timeline(iter_timeline(args.run_dir, kinds=("run", "pool", "step", "resplit_done")), header)
    if advice is None:
        print(f"error: {args.run_dir}/{FILE_NAME} has no step records and target counters yet; let the run "
              "train a few steps", file=sys.stderr)
        return 2
    print(advice.text() + ("" if advice.stable else " (few samples: a rough estimate)"))
    print(f"measured: {advice.target_tok_s:.0f} tok/s per target, {advice.drafter_tok_s:.0f} tok/s per drafter rank "
          f"(while computing); the current {advice.current_targets}/{advice.current_drafters} split is bound by "
          f"its {advice.bound_now}")
    print(f"predicted: {advice.current_predicted_tok_s:.0f} tok/s now, {advice.predicted_tok_s:.0f} tok/s advised")
    print(f"RESULT targets={advice.targets} drafters={advice.drafters} gain={advice.gain:.3f} "
          f"target_tok_s={advice.target_tok_s:.1f} drafter_tok_s={advice.drafter_tok_s:.1f} "
          f"stable={int(advice.stable)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
