"""Runs `bench gpu --acceptance`'s checks in two parts and keeps what each finished check said.

A first GPU run has a window of minutes (~8, start-up included), and a cold compile can take most of
it. So the checks come in two parts: part 1 runs what can crash a run (ordered cheapest first, budgeted
under 4 minutes on an H200), part 2 what only measures. Each check, as it finishes:
- prints its `RESULT check=... status=... seconds=...` line and a line with its time and the running
  total, flushed;
- appends one JSON line to the results file, flushed and synced: a run cut off by its window still
  leaves every finished check on disk (and the check it was in names itself in a `started` line).
A failing check (an exception) is reported as `fail` and the next one still runs. A dry run walks the
same plan without running a check (status `dry_run`): the order, each check's budget, the file.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from app.bench.common import print_result

CheckFn = Callable[[dict], "tuple[str, dict]"]
PART_NAMES = {1: "what can crash", 2: "what measures"}
PART1_BUDGET_S = 240.0  # part 1 must fit a first run's window beside start-up (issue 37)


@dataclass(frozen=True)
class Check:
    """One acceptance check: its name, part, whether it needs CUDA, a time budget on an H200 (cold caches)."""

    name: str
    fn: CheckFn
    part: int
    needs_cuda: bool
    budget_s: float


@dataclass
class Outcome:
    """What one check said."""

    name: str
    part: int
    status: str  # pass | fail | skipped | dry_run
    seconds: float
    fields: dict


class ResultsFile:
    """JSON lines appended as they arrive, each flushed and synced (a cut-off run keeps them all)."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = Path(path) if path else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")  # this run's results only

    def write(self, row: dict) -> None:
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row, sort_keys=False) + "\n")
            f.flush()
            os.fsync(f.fileno())


def run_checks(checks: list[Check], ctx: dict, parts: tuple[int, ...] = (1, 2), cuda: bool = False,
               results: str | os.PathLike | None = None, dry_run: bool = False,
               clock: Callable[[], float] = time.perf_counter) -> list[Outcome]:
    """Run the checks of `parts` in order; each reported (stdout and `results`) as soon as it ends."""
    out = ResultsFile(results)
    t0 = clock()
    outcomes: list[Outcome] = []
    for part in parts:
        todo = [c for c in checks if c.part == part]
        budget = sum(c.budget_s for c in todo)
        print(f"part {part} ({PART_NAMES.get(part, '')}): {', '.join(c.name for c in todo)}; budget {budget:.0f} s "
              "on an H200", flush=True)
        t_part = clock()
        for c in todo:
            out.write({"started": c.name, "part": part})
            outcomes.append(_one(c, ctx, cuda, dry_run, clock))
            o = outcomes[-1]
            print_result({"check": o.name, "status": o.status, "part": part, "seconds": f"{o.seconds:.1f}", **o.fields})
            print(f"  {o.name}: {o.status} in {o.seconds:.1f} s (budget {c.budget_s:.0f} s; {clock() - t0:.1f} s "
                  "since the start)", flush=True)
            out.write({"check": o.name, "part": part, "status": o.status, "seconds": round(o.seconds, 2), **o.fields})
        took = clock() - t_part
        over = part == 1 and not dry_run and took > PART1_BUDGET_S
        print(f"part {part}: {len(todo)} checks in {took:.1f} s" + (f", over its {PART1_BUDGET_S:.0f} s budget"
                                                                      if over else ""), flush=True)
        out.write({"part_done": part, "seconds": round(took, 2)})
    return outcomes


def _one(c: Check, ctx: dict, cuda: bool, dry_run: bool, clock) -> Outcome:
    if dry_run:
        t1 = clock()
        return Outcome(c.name, c.part, "dry_run", clock() - t1, {"needs_cuda": int(c.needs_cuda)})
    if c.needs_cuda and not cuda:
        return Outcome(c.name, c.part, "skipped", 0.0, {"reason": "no_cuda"})
    t1 = clock()
    try:
        status, kv = c.fn(ctx)
    except Exception as e:  # noqa: BLE001 -- one failing check is reported, and the next ones still run
        status, kv = "fail", {"error": type(e).__name__, "message": "_".join(str(e).split())[:160]}
    return Outcome(c.name, c.part, status, clock() - t1, kv)


def summary(outcomes: list[Outcome], seconds: float) -> tuple[str, int]:
    """The closing line and the exit code (1 when a check failed)."""
    failed = [o.name for o in outcomes if o.status == "fail"]
    line = (f"acceptance: {len(outcomes) - len(failed)}/{len(outcomes)} checks not failed in {seconds:.0f} s"
            + (f"; failed: {', '.join(failed)}" if failed else ""))
    return line, (1 if failed else 0)
