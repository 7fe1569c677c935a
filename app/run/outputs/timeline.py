"""The run's timeline: `<checkpoint.dir>/timeline.jsonl`, one JSON object per line, appended as it happens.

What the split advisor (`python -m app.advise`) and the report (`python -m app.report`) read after a run.
Every row has `k` (its kind) and `t` (wall-clock seconds, so a resumed run continues the same axis):
- `run`: a start of the driver, with the topology (a resumed run appends a new one);
- `step`: one StepRecord of one rank (per-position accuracy only on rank 0: it is global; rank 0's rows
  also carry the latest acceptance length measured so far, `tau` and the step it was measured at,
  `tau_step`, so each step row says what tau the weights had last shown);
- `pool`: a pool snapshot, at most every `pool_every_s` (q_hsb, jobs by state, per-target counters, and
  `restarts` by kind as this pool has counted them: a recreated pool starts from zero);
- `event`: a fault and what was done about it;
- `eval`: an acceptance-length measurement during the run (step, tau, per-position acceptance);
- `resplit`, `resplit_refused`, `resplit_done`, `resplit_measured`: an automatic re-split of targets and
  drafters (app/run/elastic/resplit_shell.py), from its decision to its measured gain.
- `grow`, `grow_done`: the drafter group growing back onto bundles lost with a node and placed again
  (app/run/elastic/grow_shell.py: old and new size, the configured one, why); `target_back`: a given-up target slot
  started again once its bundle was placed.
- `extra`, `extra_done`: an extra bundle taken from free cluster room for the short side
  (app/run/elastic/extra_shell.py: side, old and new split, shape, rates, estimated gain; then the bundle and the
  target id or the checkpoint).

A listener of the RunMonitor (`add_records`, `add_pool`, `note`); lines are flushed at once, so a killed
driver leaves a readable file (a torn last line is skipped on reading).
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

from app.storage import fence

FILE_NAME = "timeline.jsonl"

# StepRecord fields kept per row: job ids are long and say nothing the pool's counters do not.
_STEP_FIELDS = ("rank", "step", "epoch", "loss", "correct", "tokens", "accept_len", "topk_acc", "full_loss", "compute_s",
                "data_wait_s", "lr", "grad_norm")
_POOL_FIELDS = ("q_hsb", "buffered", "capacity_items", "pool_bytes", "pending", "in_flight", "leased", "acked",
                "total_jobs", "tokens_by_target", "forward_s_by_target", "done_by_target", "targets", "restarts")


class Timeline:
    """Appends rows to one run's timeline file."""

    def __init__(self, run_dir: str | Path, pool_every_s: float = 2.0, clock=time.time) -> None:
        self.path = Path(run_dir) / FILE_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.pool_every_s, self.clock = pool_every_s, clock
        self._last_pool = float("-inf")
        self._tau: dict = {}  # the latest evaluation: {"tau": ..., "tau_step": ...}
        self._fence_read, self._lost = float("-inf"), False  # `_fenced`: when the counter was read, what it said
        torn = _last_byte(self.path) not in (None, b"\n")  # one byte read: the file grows ~0.5 GiB a day
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

    def resplit_row(self, kind: str, **row) -> None:
        """A re-split row: `resplit` (asked for: old/new split, rates, estimated gain), `resplit_refused`,
        `resplit_done` (the checkpoint it resumed from, the moves) or `resplit_measured` (gain measured)."""
        self._write(kind, **row)

    def evaluation(self, step: int, tau: float, per_pos_accept: list[float], **extra) -> None:
        self._write("eval", step=step, tau=tau, per_pos_accept=list(per_pos_accept), **extra)
        self._tau = {"tau": tau, "tau_step": step}

    def close(self) -> None:
        self._file.close()

    def _write(self, kind: str, **row) -> None:
        if self._file.closed or self._fenced():
            return
        self._file.write(json.dumps({"k": kind, "t": round(self.clock(), 3), **row}, default=_plain) + "\n")
        self._file.flush()

    def _fenced(self) -> bool:
        """A local run's timeline is its checkpoint.dir's: once another run holds the folder (its lease
        taken over, app/storage/fence.py), this driver's rows are dropped, not appended to the new
        holder's. The counter is read at most once a second of the timeline's clock."""
        now = self.clock()
        if now - self._fence_read >= 1.0:
            self._fence_read, self._lost = now, fence.lost(self.path.parent)
        return self._lost


def _plain(obj):
    # numpy scalars and tuples of them; everything else in a row is already JSON.
    return obj.item() if hasattr(obj, "item") else str(obj)


def _last_byte(path: Path) -> bytes | None:
    if not path.exists() or not path.stat().st_size:
        return None
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1)


def adopt_remote(store, run_dir: str | Path) -> bool:
    """A URI run's timeline lives in a local cache and is uploaded at the end: on a new machine (or
    after another machine's start) the remote copy (`store`, the run's Storage) is the longer one, and
    becomes the local file before anything is appended. Both are append-only copies of one history, so
    the longer one holds the other. Streamed: the file is never in memory whole."""
    path = Path(run_dir) / FILE_NAME
    remote = store.file_size(FILE_NAME)
    if not remote or remote <= (path.stat().st_size if path.exists() else 0):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    store.download_file(FILE_NAME, tmp)
    tmp.replace(path)
    return True


def iter_timeline(run_dir: str | Path, kinds: tuple[str, ...] | None = None) -> Iterator[dict]:
    """The rows of `<run_dir>/timeline.jsonl` one at a time, in file order (a torn or bad line, from a
    killed driver, is skipped); only rows of `kinds` when given. A line whose kind is visibly another
    (rows are written `{"k": "<kind>", ...`) is skipped unparsed: a resume reading the evaluations
    passes over a day's million step rows at the speed of reading lines."""
    path = Path(run_dir) / FILE_NAME
    if not path.exists():
        return
    wanted = tuple(f'{{"k": "{k}"'.encode() for k in kinds) if kinds is not None else ()
    with path.open("rb") as f:
        for line in f:
            if kinds is not None and line.startswith(b'{"k": "') and not line.startswith(wanted):
                continue
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(row, dict) and (kinds is None or row.get("k") in kinds):
                yield row


def read_timeline(run_dir: str | Path) -> list[dict]:
    """Every row of `<run_dir>/timeline.jsonl`, in memory: for small files and tests. Readers of a
    long run's file use `iter_timeline` (the resume) or `report_rows` (the report)."""
    return list(iter_timeline(run_dir))


# The report draws each series on ~800 pixels: more rows than these say nothing more, and a week of
# 3 ranks at 5 steps/s is 9 million step rows (~20 GiB as Python dicts).
REPORT_STEP_ROWS = 8000  # over all ranks together (each rank at least MIN_RANK_ROWS)
REPORT_POOL_ROWS = 4000
MIN_RANK_ROWS = 256
_SUMMED = ("compute_s", "data_wait_s")  # what a kept step row adds up over the rows it stands for


class Thinned:
    """At most `cap` evenly spaced rows of a stream: every `stride`-th row is kept, and when the rows
    kept pass the cap every other one is dropped and the stride doubles (so one pass, bounded memory,
    and a series shorter than the cap is kept whole). With `summed` fields, a kept row carries their
    sum over the rows it stands for (itself and the dropped ones after it), so a share computed from
    them (compute / (compute + wait)) is the true share of that span, not one step's sample."""

    def __init__(self, cap: int, summed: tuple[str, ...] = ()) -> None:
        self.cap, self.summed = max(2, cap), summed
        self.stride, self.seen = 1, 0
        self.rows: list[tuple[int, dict]] = []  # (line index, row)

    def add(self, index: int, row: dict) -> None:
        if self.seen % self.stride == 0:
            self.rows.append((index, row))
        elif self.rows:
            last = self.rows[-1][1]
            for key in self.summed:
                last[key] = last.get(key, 0.0) + row.get(key, 0.0)
        self.seen += 1
        if len(self.rows) > self.cap:
            self.shrink(self.cap)

    def shrink(self, cap: int) -> None:
        """Halve the rows kept (and double the stride) until at most `cap` are left."""
        self.cap = max(2, cap)
        while len(self.rows) > self.cap:
            kept = self.rows[::2]
            for (_, first), (_, second) in zip(self.rows[::2], self.rows[1::2]):
                for key in self.summed:
                    first[key] = first.get(key, 0.0) + second.get(key, 0.0)
            self.rows, self.stride = kept, self.stride * 2


def report_rows(run_dir: str | Path, step_rows: int = REPORT_STEP_ROWS, pool_rows: int = REPORT_POOL_ROWS,
                min_rank_rows: int = MIN_RANK_ROWS) -> list[dict]:
    """The rows the report draws, read as a stream, in file order: every row but `step` and `pool`
    (runs, events, evaluations: few), step rows thinned per rank to `step_rows` over all ranks (plus up
    to `pool_rows` of rank 0's top-5 sampling steps), pool snapshots to `pool_rows`. Below those caps
    this is `read_timeline` exactly."""
    ranks: dict[int, Thinned] = {}
    pools, sampled = Thinned(pool_rows), Thinned(pool_rows)
    other: list[tuple[int, dict]] = []
    for index, row in enumerate(iter_timeline(run_dir)):
        kind = row.get("k")
        if kind == "step":
            rank = row.get("rank", 0)
            if rank not in ranks:
                ranks[rank] = Thinned(step_rows, _SUMMED)
                for series in ranks.values():  # one more rank: each gets a smaller share
                    series.shrink(max(min_rank_rows, step_rows // len(ranks)))
            if rank == 0 and row.get("topk_acc", -1) >= 0:
                # Sampling steps (top-5 accuracy) are a series of their own: thinning every step could
                # keep none of them. Their time is counted in the step series; here it adds nothing.
                sampled.add(index, {**row, **dict.fromkeys(_SUMMED, 0.0)})
            ranks[rank].add(index, row)
        elif kind == "pool":
            pools.add(index, row)
        else:
            other.append((index, row))
    kept = dict(sampled.rows)
    kept.update(pools.rows)
    kept.update(other)
    for series in ranks.values():  # a sampling step kept in its rank's series too: that copy (with its sums) wins
        kept.update(series.rows)
    return [kept[i] for i in sorted(kept)]
