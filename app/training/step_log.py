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
It uses only the step numbers the ranks reported, not the pool's ledger, so a job trained twice in
the final weights shows up as trained twice.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

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
    reads each step's ranks from it)."""
    kept: dict[int, list[list[int]]] = {}  # step -> job ids of each rank's record of that step
    starts = 0
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "group_start" in row:
            starts += 1
            for step in [s for s in kept if s > row["group_start"]]:
                del kept[step]
        else:
            kept.setdefault(int(row["step"]), []).append([int(j) for j in row["job_ids"]])
    return kept, starts
