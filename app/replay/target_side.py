"""The TargetActor's side of replay: look a job up before its forward, keep its features after one.

Writes go through one background thread with a short queue, so a forward does not wait for the disk
(or the bucket) unless the writer falls two jobs behind. A lookup of a job whose sequences are still
queued for writing waits for them first, so a job of the next epoch never forwards what is about to land.
The target's own counters (`TargetCounts`: forwards and replay hits, counted by the actor, not by the
store) are kept in `<run dir>/replay-counts/target-<id>-<pid>.json` after each job, for tests and people.
"""
from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from app.messages import HiddenBatch
from app.replay.backend import open_backend
from app.replay.jobs import keep_job, replay_job
from app.replay.key import ReplayKey, sequence_name, weights_digest
from app.replay.spec import ReplaySpec, resolve_location
from app.replay.store import ReplayStore

COUNTS_DIR = "replay-counts"
QUEUE_JOBS = 2  # forwarded jobs waiting for the writer, at most (each holds its payload in memory)


@dataclass
class TargetCounts:
    """A target's jobs by how their features came: its own forward, or the replay store."""

    forwards: int = 0
    replay_hits: int = 0


class TargetReplay:
    """A target's replay store and its writer thread."""

    def __init__(self, store: ReplayStore) -> None:
        self.store = store
        self.pending: dict[str, int] = {}  # entry names queued for writing -> queued copies
        self.cond = threading.Condition()
        self.jobs: queue.Queue = queue.Queue(maxsize=QUEUE_JOBS)
        self.writer = threading.Thread(target=self._write_loop, name="replay-writer", daemon=True)
        self.writer.start()

    @classmethod
    def open(cls, spec: ReplaySpec, model_dir: str, layer_ids: list[int], payload_dtype: str,
             log: Callable[[str], None] = print) -> "TargetReplay | None":
        """The target's replay, or None (said in one line) when the store cannot be opened: the target then
        forwards every job, as with replay off."""
        from app.storage.roots import redact

        key = ReplayKey(weights=weights_digest(model_dir), layers=tuple(int(x) for x in layer_ids),
                        payload_dtype=payload_dtype)
        try:
            store = ReplayStore(open_backend(resolve_location(spec.location)), key, spec.max_bytes, spec.writers,
                                spec.target, log)
        except Exception as e:  # noqa: BLE001 - a store gone since the config check must not stop the target
            log(f"replay: {redact(spec.location)} cannot be opened ({type(e).__name__}: {redact(str(e))[:200]}); "
                "this target forwards every job")
            return None
        return cls(store)

    def lookup(self, job_id: int, seqs: list) -> HiddenBatch | None:
        """The job's batch from the store, or None (the target forwards it)."""
        names = [sequence_name(ids) for ids, _ in seqs]
        with self.cond:
            self.cond.wait_for(lambda: not any(n in self.pending for n in names))
        return replay_job(self.store, job_id, seqs)

    def keep(self, batch: HiddenBatch) -> None:
        """Queue a forwarded batch for writing (blocks while the writer is QUEUE_JOBS behind)."""
        if not self.store.enabled:
            return
        names = [sequence_name(batch.input_ids_BS[r, :n]) for r, n in enumerate(batch.lengths_B.tolist())]
        with self.cond:
            for n in names:
                self.pending[n] = self.pending.get(n, 0) + 1
        self.jobs.put((batch, names))

    def flush(self) -> None:
        """Wait until every queued batch is written (tests; the end of a bench)."""
        self.jobs.join()

    def _write_loop(self) -> None:
        while True:
            batch, names = self.jobs.get()
            try:
                keep_job(self.store, batch)
            except Exception as e:  # noqa: BLE001 - a full disk, a bucket's error: the writer must live on, the run trains
                self.store.log(f"replay: writing job {batch.job_id} failed ({type(e).__name__}: {e})")
            finally:
                with self.cond:
                    for n in names:
                        self.pending[n] -= 1
                        if not self.pending[n]:
                            del self.pending[n]
                    self.cond.notify_all()
                self.jobs.task_done()


def save_counts(run_dir: str, target_id: int, counts: TargetCounts) -> None:
    """The target's counters into this incarnation's file under the run's local folder (replaced whole)."""
    from app.storage.roots import local_cache_dir

    folder = Path(local_cache_dir(run_dir)) / COUNTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"target-{target_id}-{os.getpid()}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(counts)))
    tmp.replace(path)


def read_counts(run_dir: str) -> TargetCounts:
    """Every target incarnation's counters of a run, summed."""
    from app.storage.roots import local_cache_dir

    total = TargetCounts()
    for path in sorted((Path(local_cache_dir(run_dir)) / COUNTS_DIR).glob("target-*.json")):
        got = json.loads(path.read_text())
        total.forwards += int(got.get("forwards", 0))
        total.replay_hits += int(got.get("replay_hits", 0))
    return total


def replay_summary(replay: str, run_dir: str) -> dict:
    """summary.json's replay figures (pool.replay on): forwards and replay hits of every target incarnation,
    summed from their own count files (a killed target's last save included), not from the store."""
    if replay == "off":
        return {}
    counts = read_counts(run_dir)
    return {"replay_forwards": counts.forwards, "replay_hits": counts.replay_hits}
