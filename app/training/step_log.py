"""The step log: every step record's job ids, appended as JSON lines, and an independent count of them.

With `logging.step_log: true` two writers append to `<checkpoint.dir>/steps.jsonl`:
- drafter rank 0, right after each step's all-gather of job ids: `{"rank": r, "step": s, "job_ids": [...]}`
  for every rank r (the jobs that rank put into optimizer step s). Rank 0 writes it before it can
  checkpoint step s, so every step inside a checkpoint is in the log, whatever dies afterwards (the
  pool, which relays the ranks' telemetry to the driver, used to hold these records: a pool crash
  right after a checkpoint lost them);
- the driver: `{"group_start": k}` whenever a drafter group starts from step k (a fresh start, a
  resume, or a rebuild after a crash rolled the weights back to the checkpoint of step k). The old
  group cannot append after its replacement starts: a dead rank blocks the others' next all-gather.

`count_trained` replays that log: a group start at k discards the records of steps after k (their
updates were lost with the crashed group), and what is left is the lineage of the final weights.

Both writers are fenced as the run's other files are (app/storage/fence.py): once another run holds the
folder (a driver stopped past its lease while its rank 0 trained on), their rows are dropped, and every
row carries the writer's fencing token, so one that slipped in between that check and its append (a
pause) is ignored by the replay when it follows a row of a newer token.
It uses only the step numbers the ranks reported, not the pool's ledger, so a job trained twice in
the final weights shows up as trained twice.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from app.storage import fence

FILE_NAME = "steps.jsonl"


class StepLog:
    """Appends steps' job ids and group starts to one JSON-lines file (local checkpoint dirs only)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def step(self, step: int, job_ids_per_rank: list[list[int]]) -> None:
        """Optimizer step `step` trained `job_ids_per_rank[r]` on rank r (one line per rank)."""
        self._append([{"rank": r, "step": step, "job_ids": list(ids)} for r, ids in enumerate(job_ids_per_rank)])

    def group_start(self, step: int) -> None:
        self._append([{"group_start": step}])

    def _append(self, rows: list[dict]) -> None:
        """Fenced (app/storage/fence.py): a writer whose run lost the folder appends nothing (its rows are
        dropped, as the local timeline's are), and each row carries the writer's token for the window
        between that check and the append (`lineage` ignores a row of an older token than one before it)."""
        if fence.lost(self.path.parent):
            return
        token = fence.held(self.path.parent)
        if token:
            rows = [{**row, "token": token} for row in rows]
        with self.path.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))


@dataclass(frozen=True)
class TrainedCounts:
    """How often each job id went into the final weights' lineage of optimizer steps."""

    times: dict[int, int]  # job id -> optimizer steps of the final lineage that contained it
    group_starts: int

    def count(self, scheduled: int, quarantined: int = 0) -> dict[str, int]:
        once = sum(1 for n in self.times.values() if n == 1)
        twice = sum(1 for n in self.times.values() if n >= 2)
        return {"trained_once": once, "trained_twice": twice,
                "never_trained": max(0, scheduled - quarantined - len(self.times))}


def count_trained(path: str | Path) -> TrainedCounts:
    """Replay the step log (see the module docstring); a torn last line (killed writer) is skipped."""
    kept, starts = lineage(path)
    times = Counter(j for per_rank in kept.values() for ids in per_rank for j in ids)
    return TrainedCounts(dict(times), starts)


def lineage(path: str | Path) -> tuple[dict[int, list[list[int]]], int]:
    """(step -> the job ids of each rank's record of that step, in the order written; group starts): the
    steps of the final weights' lineage, as `count_trained` replays them (`python -m app.bench rebalance`
    reads each step's ranks from it). The file is read as hostile input: a line that is not one of the
    two record shapes is skipped, and so is a row of an older fencing token than a row before it (a run
    that lost the folder appended it after the new holder's rows)."""
    kept: dict[int, list[list[int]]] = {}  # step -> job ids of each rank's record of that step
    starts, newest = 0, 0
    for line in Path(path).read_text().splitlines():
        row = _row(line)
        if row is None:
            continue
        token = row.get("token", 0)
        if token < newest:
            continue
        newest = token
        if "group_start" in row:
            starts += 1
            for step in [s for s in kept if s > row["group_start"]]:
                del kept[step]
        else:
            kept.setdefault(row["step"], []).append(row["job_ids"])
    return kept, starts


def _row(line: str) -> dict | None:
    """A step record or a group start with integer fields (and an integer token, if any); else None."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(row, dict) or not _int(row.get("token", 0)):
        return None
    if "group_start" in row:
        return row if _int(row["group_start"]) else None
    ids = row.get("job_ids")
    if _int(row.get("step")) and isinstance(ids, list) and all(_int(j) for j in ids):
        return row
    return None


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
