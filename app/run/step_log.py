"""The step log: every step record's job ids, appended as JSON lines, and an independent count of them.

With `logging.step_log: true` the driver appends to `<checkpoint.dir>/steps.jsonl`:
- `{"rank": r, "step": s, "job_ids": [...]}` for each record a rank reported to the pool (the jobs
  that rank put into optimizer step s);
- `{"group_start": k}` whenever a drafter group starts from step k (a fresh start, a resume, or a
  rebuild after a crash rolled the weights back to the checkpoint of step k).

`count_trained` replays that log: a group start at k discards the records of steps after k (their
updates were lost with the crashed group), and what is left is the lineage of the final weights.
It uses only the step numbers the ranks reported, not the pool's ledger, so a job trained twice in
the final weights shows up as trained twice.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from app.messages import StepRecord

FILE_NAME = "steps.jsonl"


class StepLog:
    """Appends step records and group starts to one JSON-lines file (local checkpoint dirs only)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def records(self, records: list[StepRecord]) -> None:
        if records:
            self._append([{"rank": r.rank, "step": r.step, "job_ids": list(r.job_ids)} for r in records])

    def group_start(self, step: int) -> None:
        self._append([{"group_start": step}])

    def _append(self, rows: list[dict]) -> None:
        with self.path.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))


@dataclass(frozen=True)
class TrainedCounts:
    """How often each job id went into the final weights' lineage of optimizer steps."""

    times: dict[int, int]  # job id -> optimizer steps of the final lineage that contained it
    group_starts: int
    unlogged_steps: int = 0  # steps inside a resumed checkpoint that no record reached the log for

    def count(self, scheduled: int, quarantined: int = 0) -> dict[str, int]:
        once = sum(1 for n in self.times.values() if n == 1)
        twice = sum(1 for n in self.times.values() if n >= 2)
        return {"trained_once": once, "trained_twice": twice,
                "never_trained": max(0, scheduled - quarantined - len(self.times))}


def count_trained(path: str | Path) -> TrainedCounts:
    """Replay the step log (see the module docstring); a torn last line (killed writer) is skipped."""
    kept: dict[int, list[list[int]]] = {}  # step -> job ids of each rank's record of that step
    starts = unlogged = 0
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "group_start" in row:
            starts += 1
            # A resume point beyond the last logged step: those steps' records died with the pool
            # (it holds them until the driver drains them). Their jobs are in the weights but not here.
            unlogged += max(0, row["group_start"] - max(kept, default=0)) if starts > 1 else 0
            for step in [s for s in kept if s > row["group_start"]]:
                del kept[step]
        else:
            kept.setdefault(int(row["step"]), []).append([int(j) for j in row["job_ids"]])
    times = Counter(j for per_rank in kept.values() for ids in per_rank for j in ids)
    return TrainedCounts(dict(times), starts, unlogged)
