"""wandb history a person can read (`logging.wandb_mode`: offline, online, disabled).

One history row per optimizer step (`StepRows`: loss, accuracy, the per-position acceptance of the
step's blocks, lr, grad norm, tokens and data-wait share over every rank, the latest status-line
numbers under `status/` and the pool per length bucket under `pool/`), with `tau` and `tau_best` in
the row of the step each evaluation measured (app/run/outputs/wandb_rows.py holds rows back until
then), and one row per event: each fault (`event: fault`) and each re-split row (`event: resplit...`).
The logger is a RunMonitor listener, fed the same stream as the timeline; the status line refreshes
the `status/` and `pool/` values. wandb's own step counts rows; the optimizer step is the `step` field
(a rollback repeats step numbers, so it cannot be wandb's monotonic step). `read_history` reads an
offline run file back (the tests use it).
"""
from __future__ import annotations

import json
import struct
from dataclasses import asdict
from pathlib import Path
from typing import Any

from app.config.errors import ConfigError
from app.config.run_sections import LoggingConfig
from app.config.schema import Config
from app.run.outputs.wandb_rows import TauRows, health_keys, pool_keys
from app.storage.roots import redact

# Keys of every step row (the per-position acceptance adds acc_pos1..acc_pos{B-1}).
STEP_KEYS = ("step", "epoch", "loss", "accuracy", "accept_len", "lr", "grad_norm", "tokens", "data_wait", "ranks")
# The status line's run-level numbers a step row carries under `status/` (the rest is in the row itself).
STATUS_KEYS = ("target_tok_s", "train_tok_s", "data_wait", "buffered", "acked", "total_jobs", "tau", "tau_best")


def _first_line(exc: BaseException) -> str:
    text = redact(str(exc)).strip()
    return text.splitlines()[0] if text else "no message"


class StepRows:
    """Folds every rank's StepRecords into one row per optimizer step. A step's row is complete when a
    record of another step arrives (ranks report independently, so a step's records may come in two
    batches) or at `flush`; no group size is assumed, so a shrunk or re-split group still gets rows."""

    def __init__(self) -> None:
        self._step: int | None = None
        self._records: list = []

    def add(self, records) -> list[dict[str, Any]]:
        rows = []
        for rec in records:
            if self._step is not None and rec.step != self._step:
                rows += self.flush()
            self._step = rec.step
            self._records.append(rec)
        return rows

    @property
    def pending_step(self) -> int | None:
        """The step whose row is still open (its records so far, no record of another step yet)."""
        return self._step

    def flush(self) -> list[dict[str, Any]]:
        recs, self._step, self._records = self._records, None, []
        if not recs:
            return []
        first = min(recs, key=lambda r: r.rank)  # rank 0's: the global numbers (loss, accuracy, per-position)
        wait, comp = sum(r.data_wait_s for r in recs), sum(r.compute_s for r in recs)
        row = {"step": first.step, "epoch": first.epoch, "loss": first.loss, "accuracy": first.correct,
               "accept_len": first.accept_len, "lr": first.lr, "grad_norm": first.grad_norm,
               "tokens": sum(r.tokens for r in recs), "data_wait": wait / (wait + comp) if wait + comp > 0 else 0.0,
               "ranks": len({r.rank for r in recs})}
        row.update({f"acc_pos{k + 1}": a for k, a in enumerate(first.per_pos_acc)})
        if first.topk_acc >= 0:
            row["top5_acc"] = first.topk_acc
        if first.full_loss >= 0 and first.full_loss != first.loss:  # a sampled-softmax step's exact loss
            row["full_loss"] = first.full_loss
        return [row]


class WandbLogger:
    """A no-op when disabled; otherwise one wandb run per drafter run (a sweep's runs live side by side in the
    driver process), resumed by run name (unique per checkpoint.dir, app/run/plan.py run_name). A failing wandb.init is a ConfigError: one line, exit 2.

    A RunMonitor listener (`add_records`, `add_pool`, `note`, `resplit_row`); `log` takes the status-line
    values, which ride on the next step row."""

    def __init__(self, cfg: LoggingConfig, run_name: str, full: Config, monitor=None, resumed_step: int = 0,
                 several: bool = False) -> None:
        """`several`: a run of a sweep, one wandb run of several live at once in this process."""
        self.run = None
        self.monitor, self.resumed_step = monitor, resumed_step
        self.rows = StepRows()
        self.status: dict[str, float] = {}
        # The steps rank 0 offers for evaluation: their rows wait for their tau.
        self.tau_rows = TauRows(every=monitor.eval_every if monitor is not None else 0)
        self._taus_seen, self._given_up_seen, self._best = 0, 0, float("-inf")
        self.faults = 0
        self.finished = False
        if cfg.wandb_mode == "disabled":
            return
        import wandb

        from app.storage.roots import local_cache_dir  # wandb writes local files, even for s3:// runs

        config = asdict(full)
        config["checkpoint"]["dir"] = redact(full.checkpoint.dir)  # wandb uploads its config: no URI credentials
        try:
            self.run = wandb.init(project=cfg.wandb_project, name=run_name, id=run_name, resume="allow",
                                  mode=cfg.wandb_mode, config=config, dir=str(local_cache_dir(full.checkpoint.dir)),
                                  **({"reinit": "create_new"} if several else {}))
        except (wandb.errors.Error, OSError, RuntimeError, TimeoutError, ValueError) as exc:  # no key, no network
            raise ConfigError(f"wandb.init failed for logging.wandb_mode={cfg.wandb_mode} "
                              f"({type(exc).__name__}: {_first_line(exc)}); log in (wandb login, or WANDB_API_KEY), "
                              "or set logging.wandb_mode=offline or disabled") from None
        if monitor is not None:
            monitor.listen(self)

    # ---- RunMonitor listener ---------------------------------------------------------------

    def add_records(self, records) -> None:
        for row in self.rows.add(records):
            self._emit({**row, **self.status})
        self._taus()

    def add_pool(self, _stats) -> None:
        self._taus()

    def note(self, event: str) -> None:
        self.faults += 1
        self._emit({"event": "fault", "event_text": redact(event), "faults_total": self.faults})

    def resplit_row(self, kind: str, **row) -> None:
        """A re-split asked for, refused, done or measured (app/run/elastic/resplit_shell.py): its numbers, as an event."""
        flat = {f"{kind}/{k}": v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        text = {k: v for k, v in row.items() if not isinstance(v, (int, float)) or isinstance(v, bool)}
        self._emit({"event": kind, "event_text": json.dumps(text, default=str), **flat})

    # ---- status line and end ------------------------------------------------------------------

    def log(self, values: dict[str, Any]) -> None:
        """The status-line values and the pool per bucket: kept, written with the next step row under
        `status/` and `pool/`."""
        self.status = {f"status/{k}": values[k] for k in STATUS_KEYS
                       if isinstance(values.get(k), (int, float)) and not isinstance(values.get(k), bool)}
        self.status.update(pool_keys(self.monitor.last_pool if self.monitor is not None else None))
        self._taus()

    def finish(self, summary: dict[str, Any], exit_code: int = 0) -> None:
        """The last rows, the summary's numbers and the run's end; once (later calls do nothing), so the
        driver also calls it for a stopped or failed run, whose last steps' rows would be lost otherwise."""
        if self.finished:
            return
        self.finished = True
        for row in self.rows.flush():
            self._emit({**row, **self.status})
        self._taus()
        for row in self.tau_rows.flush():
            self._write(row)
        if self.run is not None:
            self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float))})
            self.run.finish(exit_code=exit_code)

    def _taus(self) -> None:
        """New tau evaluations of the monitor into their steps' rows (this start's only: a resume re-reads
        the earlier ones), and the evaluations the runner gave up on, which hold no row any more."""
        if self.monitor is None:
            return
        history = self.monitor.tau_history
        for step, tau in history[self._taus_seen:]:
            if self.rows.pending_step is not None and step >= self.rows.pending_step:
                break  # its step's row is still open: it goes in once that row is complete
            self._best = max(self._best, tau)  # the best up to this evaluation, earlier starts included
            if step > self.resumed_step or self.resumed_step == 0:
                health = self.monitor.health_by_step.get(step)
                self._write_all(self.tau_rows.add_tau(step, tau, self._best, health_keys(health)))
            self._taus_seen += 1
        given_up = self.monitor.tau_given_up
        for step in given_up[self._given_up_seen:]:
            self._write_all(self.tau_rows.give_up(step))
        self._given_up_seen = len(given_up)

    def _emit(self, row: dict[str, Any]) -> None:
        """A row, in order behind the step rows still waiting for their tau."""
        self._write_all(self.tau_rows.add_row(row))

    def _write_all(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self._write(row)

    def _write(self, row: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.log(row)


# ---- reading an offline run back --------------------------------------------------------------

_BLOCK, _HEADER = 32768, 7  # wandb's run file: LevelDB log blocks of 32 KiB, 7-byte record headers


def read_history(run_file: str | Path) -> list[dict[str, Any]]:
    """The history rows of a wandb run file (`<dir>/wandb/offline-run-*/run-*.wandb`), in order.
    The file is LevelDB's log format (a 7-byte file header `:W&B`, then records of protobuf `Record`s
    cut into 32 KiB blocks: full, or first/middle/last pieces)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(run_file).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{run_file} is not a wandb run file")
    pos, pending, rows = _HEADER, b"", []
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        piece = data[pos + _HEADER: pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0 and length == 0:  # zero padding up to the block's end
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0
            continue
        pending = piece if kind in (1, 2) else pending + piece
        if kind not in (1, 4):  # first or middle piece: the record goes on
            continue
        record = pb.Record()
        record.ParseFromString(pending)
        pending = b""
        if record.WhichOneof("record_type") == "history":
            rows.append({(item.key or ".".join(item.nested_key)): _item_value(item) for item in record.history.item})
    return rows


def _item_value(item) -> Any:
    if item.value_json:
        return json.loads(item.value_json)
    which = item.WhichOneof("value") if "value" in [o.name for o in item.DESCRIPTOR.oneofs] else None
    return getattr(item, which) if which else None
