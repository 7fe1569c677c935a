"""The run's timeline: `<checkpoint.dir>/timeline.jsonl`, one JSON object per line, appended as it happens.

What the split advisor (`python -m app.advise`) and the report (`python -m app.report`) read after a run.
Every row has `k` (its kind) and `t` (wall-clock seconds, so a resumed run continues the same axis):
- `run`: a start of the driver, with the topology (a resumed run appends a new one);
- `step`: one StepRecord of one rank (per-position accuracy only on rank 0: it is global; rank 0's rows
  also carry the latest acceptance length measured so far, `tau` and the step it was measured at,
  `tau_step`, so each step row says what tau the weights had last shown);
- `pool`: a pool snapshot, at most every `pool_every_s` (q_hsb, jobs by state, per-target counters);
- `event`: a fault and what was done about it;
- `eval`: an acceptance-length measurement during the run (step, tau, per-position acceptance).

A listener of the RunMonitor (`add_records`, `add_pool`, `note`); lines are flushed at once, so a killed
driver leaves a readable file (a torn last line is skipped on reading).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

FILE_NAME = "timeline.jsonl"

# StepRecord fields kept per row: job ids are long and say nothing the pool's counters do not.
_STEP_FIELDS = ("rank", "step", "epoch", "loss", "correct", "tokens", "accept_len", "topk_acc", "compute_s",
                "data_wait_s", "lr", "grad_norm")
_POOL_FIELDS = ("q_hsb", "buffered", "capacity_items", "pool_bytes", "pending", "in_flight", "leased", "acked",
                "total_jobs", "tokens_by_target", "forward_s_by_target", "done_by_target", "targets")


class Timeline:
    """Appends rows to one run's timeline file."""

    def __init__(self, run_dir: str | Path, pool_every_s: float = 2.0, clock=time.time) -> None:
        self.path = Path(run_dir) / FILE_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.pool_every_s, self.clock = pool_every_s, clock
        self._last_pool = float("-inf")
        self._tau: dict = {}  # the latest evaluation: {"tau": ..., "tau_step": ...}
        torn = self.path.exists() and self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n")
        self._file = self.path.open("a", encoding="utf-8")
        if torn:  # a killed driver's half line must not swallow this start's first row
            self._file.write("\n")

    def start(self, topology, run_name: str = "", resumed_step: int = 0) -> None:
        self._write("run", num_targets=topology.num_targets, num_drafters=topology.num_drafters,
                    gpus_per_target=topology.gpus_per_target, gpus_per_drafter=topology.gpus_per_drafter,
                    run_name=run_name, resumed_step=resumed_step)

    def add_records(self, records) -> None:
        for rec in records:
            row = {f: getattr(rec, f) for f in _STEP_FIELDS}
            if rec.rank == 0:
                row["per_pos_acc"] = list(rec.per_pos_acc)
                row.update(self._tau)
            self._write("step", **row)

    def add_pool(self, stats, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self._last_pool < self.pool_every_s:
            return
        self._last_pool = now
        self._write("pool", **{f: getattr(stats, f) for f in _POOL_FIELDS})

    def note(self, event: str) -> None:
        self._write("event", text=event)

    def evaluation(self, step: int, tau: float, per_pos_accept: list[float], **extra) -> None:
        self._write("eval", step=step, tau=tau, per_pos_accept=list(per_pos_accept), **extra)
        self._tau = {"tau": tau, "tau_step": step}

    def close(self) -> None:
        self._file.close()

    def _write(self, kind: str, **row) -> None:
        if self._file.closed:
            return
        self._file.write(json.dumps({"k": kind, "t": round(self.clock(), 3), **row}, default=_plain) + "\n")
        self._file.flush()


def _plain(obj):
    # numpy scalars and tuples of them; everything else in a row is already JSON.
    return obj.item() if hasattr(obj, "item") else str(obj)


def adopt_remote(remote: bytes | None, run_dir: str | Path) -> bool:
    """A URI run's timeline lives in a local cache and is uploaded at the end: on a new machine (or
    after another machine's start) the remote copy is the longer one, and becomes the local file before
    anything is appended. Both are append-only copies of one history, so the longer one holds the other."""
    path = Path(run_dir) / FILE_NAME
    if not remote or len(remote) <= (path.stat().st_size if path.exists() else 0):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(remote)
    tmp.replace(path)
    return True


def read_timeline(run_dir: str | Path) -> list[dict]:
    """Every row of `<run_dir>/timeline.jsonl` (a torn last line, from a killed driver, is skipped)."""
    path = Path(run_dir) / FILE_NAME
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
