"""The pool actor's own state beside the pool: a plain class, no Ray.

`PoolControl` is what `actors/hs_pool.py` decides and remembers that is not the job pipeline itself:
which targets are registered and which of them are paused (evaluating: no training jobs meanwhile),
the target failures seen, the live-evaluation offer (newest wins), the driver's stop request, the
drafters' step records (relayed to the driver, folded into the metrics) and the reports the driver
sends for the metrics (tau, restarts). Target handles are opaque here; the actor launches the calls.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

from app.messages import JobSpec, StepRecord, TargetFailure
from app.pool.hs_pool import HSPool
from app.pool.telemetry import PoolStats


class PoolControl:
    """Targets (registered, paused, failed), the eval offer, the stop flag, step records, reports."""

    def __init__(self, pool: HSPool, unexported: int = 4096) -> None:
        """`unexported`: step records kept for the metrics exporter until it reads them (bounded:
        records reported before the exporter starts, or while it is stuck, must not pile up)."""
        self.pool = pool
        self._targets: dict[int, Any] = {}
        self._paused: dict[int, set[str]] = {}  # target -> who paused it (the runs of a sweep; "" for one run)
        self.failures: list[TargetFailure] = []  # oldest first
        self._offer: tuple[int, list] | None = None
        self.offers_superseded = 0  # offers replaced by a newer one before the driver took them
        self.stop_requested = False
        self._undrained: list[StepRecord] = []  # for the driver's step log and status line
        self._unexported: deque[StepRecord] = deque(maxlen=unexported)
        self.tau: float | None = None
        self.health: dict | None = None  # the latest evaluation's learning checks (PoolStats.health)
        self.restarts: dict[str, int] = {}

    # ---- targets --------------------------------------------------------------------------

    def add_target(self, target_id: int, handle: Any) -> None:
        """Register (or replace after a restart) a target; the old incarnation's jobs are re-queued."""
        if self.pool.in_flight_count(target_id):
            self.pool.target_lost(target_id)
        self.pool.target_added(target_id)
        self._targets[target_id] = handle
        self.pool.notify()

    def targets(self) -> list[tuple[int, Any]]:
        """The registered targets and their handles, by id."""
        return sorted(self._targets.items(), key=lambda kv: kv[0])

    def next_job(self, target_id: int, handle: Any) -> JobSpec | None:
        """The next training job for this incarnation of the target: None once it was replaced or
        removed, while it is paused, or when the pool has none for it."""
        if self._targets.get(target_id) is not handle or target_id in self._paused:
            return None
        return self.pool.next_job(target_id)

    def target_raised(self, target_id: int, handle: Any, job_id: int, error_type: str, error: str) -> None:
        """The job's forward raised but the target lives: only the job failed (see HSPool.job_raised),
        with the error's last line (a traceback ends with the exception). A target that this made
        broken (it raised on every job lately) is dropped like a dead one, its jobs re-queued without
        a strike, and its failure recorded: the supervisor restarts it within its budget."""
        if self._targets.get(target_id) is not handle:
            return
        lines = _lines(error)
        last = lines[-1][:300] if lines else error_type
        self.pool.job_raised(target_id, job_id, last)
        if self.pool.target_broken(target_id):
            del self._targets[target_id]
            self.pool.target_lost(target_id)
            raises = self.pool.broken_after
            self.failures.append(TargetFailure(target_id, job_id, f"broken: its forward raised on {raises} jobs in a "
                                               f"row (supervision.broken_target_raises={raises}); last: {last}"))

    def target_died(self, target_id: int, handle: Any, job_id: int, error_type: str, error: str) -> None:
        """The target is gone: its jobs go back to the queue and the failure is recorded. Only the
        registered incarnation counts: a replaced one's jobs were re-queued when it was replaced, and
        the job id may now run on the new incarnation."""
        if self._targets.get(target_id) is not handle:
            return
        self.pool.job_failed(target_id, job_id)
        del self._targets[target_id]
        self.pool.target_lost(target_id)
        first = (_lines(error) or [""])[0][:300]
        self.failures.append(TargetFailure(target_id, job_id, f"{error_type}: {first}"))

    def remove_target(self, target_id: int) -> list[int]:
        """The target leaves the run (a re-split gives its bundle to the drafters): no more jobs for it,
        the ones it still holds go back to the front of the queue, and a late answer or failure of it
        is ignored like a replaced incarnation's. Returns the re-queued job ids."""
        if self._targets.pop(target_id, None) is None:
            return []
        self._paused.pop(target_id, None)
        ids = self.pool.target_lost(target_id)
        self.pool.notify()
        return ids

    def pause(self, target_id: int, by: str = "") -> None:
        """Issue no training jobs to this target (it evaluates); the ones it holds finish. `by`: the run of a
        sweep evaluating on it; the target trains again once every run that paused it resumed it."""
        self._paused.setdefault(target_id, set()).add(by)

    def resume(self, target_id: int, by: str = "") -> None:
        pausers = self._paused.get(target_id, set())
        pausers.discard(by)
        if not pausers:
            self._paused.pop(target_id, None)
        self.pool.notify()

    # ---- evaluation offers, stop ----------------------------------------------------------

    def offer_eval(self, step: int, weights: list) -> None:
        """Rank 0's weights at `step`; a newer offer replaces one not yet taken (counted), so
        evaluation never queues up behind training."""
        if self._offer is not None:
            self.offers_superseded += 1
        self._offer = (step, weights)

    def take_eval(self) -> tuple[int, list] | None:
        """The newest offer, once."""
        offer, self._offer = self._offer, None
        return offer

    def request_stop(self) -> None:
        self.stop_requested = True

    def clear_stop(self) -> None:
        """The stop was a re-split's checkpoint, not the run's end: the rebuilt group trains on."""
        self.stop_requested = False

    # ---- step records and reports ---------------------------------------------------------

    def report_step(self, rec: StepRecord) -> None:
        """One rank's step: feeds the pool's step-mix measure, the driver's drain and the metrics."""
        self.pool.record_step(rec.step, rec.job_ids)
        self._undrained.append(rec)
        self._unexported.append(rec)

    def drain_step_records(self) -> list[StepRecord]:
        """Step records reported since the previous drain (for the driver's logging)."""
        out, self._undrained = self._undrained, []
        return out

    def take_unexported(self) -> list[StepRecord]:
        """Step records the metrics exporter has not folded in yet, oldest first."""
        out = list(self._unexported)
        self._unexported.clear()
        return out

    def report_tau(self, tau: float, health: dict | None = None) -> None:
        self.tau = tau
        if health is not None:
            self.health = health

    def report_restart(self, kind: str) -> None:
        self.restarts[kind] = self.restarts.get(kind, 0) + 1

    def stats(self, targets: PoolControl | None = None) -> PoolStats:
        """The pool's snapshot with this state filled in; the target fields from `targets` (the stream's
        control, for one run of several on one stream) when given."""
        shared = targets or self
        return dataclasses.replace(
            self.pool.stats(), target_failures=list(shared.failures), targets=sorted(shared._targets),
            paused_targets=sorted(shared._paused), eval_offers_superseded=self.offers_superseded,
            restarts=dict(self.restarts), tau=self.tau, health=self.health,
        )


def _lines(error: str) -> list[str]:
    return [line for line in error.strip().splitlines() if line.strip()]
