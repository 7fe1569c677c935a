# Over 300 lines: the stream over the runs' pools and the control state beside it are the pool actor's one state.
"""Drafter runs on one capture stream, and the pool actor's control state: plain classes, no Ray.

The pool actor always holds a `SharedStream`: a single run is a stream of one run (named ""); a sweep
(`runs:` in the config, `app/config/sweep_section.py`) trains several drafters on the same data, schedule
and targets. `SharedStream` keeps one `HSPool` per run (its own queue, buffer, leases, ledger, rollbacks,
end-of-stream: everything a run's drafter group sees is what a single run sees) and is the producing side
for all of them: a target forward runs once for every run that still needs the job, and its payload ref
goes to each of those runs' buffers. The ref lives while any run holds it (Ray counts the references),
so it is freed once every run has pulled and acked it.

Issuing a job (`next_job`): each run's pool names the job it would issue next (`candidate`); the job
goes to every run where it is still pending, and only when it fits every one of them and the stream's
own budget. That budget counts a ref shared by several runs once: items = jobs buffered or in flight in
any run, bytes = jobs held (in flight, buffered or leased) in any run. Per run, exactly-once stays the
run's own ledger; a job is done for the stream when every run acked it.

A slower or dead run: the fast runs wait, bounded by the budget. While one run's buffer holds the
budget, no new job is issued, so the others starve (a dead run's drafters are rebuilt by the supervisor
as in a single run, and it drains its buffer). Nothing is recomputed for the slow run's sake, and no
run trains ahead of the budget. A run whose own leases are part of what holds the shared budget drains
its step (`Production.stalled`), as a single run does when its leases hold its own budget. A stream of
one run has no shared budget to check: its run's own budget counts exactly what the stream's would (the
same jobs, one reservation each), so the gate and its per-job tally are left out, and its pool issues and
drains as a pool of its own.

`PoolControl` is what `actors/hs_pool.py` decides and remembers that is not the job pipeline itself, one
over the stream (its targets: which are registered, which of them are paused, evaluating, with no training
jobs meanwhile, the failures seen) and one over each run's pool (the live-evaluation offer, newest wins;
the driver's stop request; the drafters' step records, relayed to the driver and folded into the metrics;
the reports the driver sends for the metrics: tau, restarts). Target handles are opaque here; the actor
launches the calls.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from app.config.schema import PoolConfig
from app.data.schedule import EpochJobs
from app.messages import ItemMeta, JobSpec, StepRecord, TargetFailure
from app.pool.book import JobState
from app.pool.hs_pool import HSPool
from app.pool.telemetry import PoolStats


_HELD = (JobState.IN_FLIGHT, JobState.BUFFERED, JobState.LEASED)  # a run holds the job's ref (or reservation)
_COUNTED = (JobState.IN_FLIGHT, JobState.BUFFERED)  # and counts it against pool.capacity (leases do not)


@dataclass(frozen=True)
class RunShape:
    """What one run's pool needs to size a global step: its drafter ranks (None: as many as pull) and
    train.grad_accum."""

    ranks: int | None
    accum: int = 1


@dataclass
class _Issue:
    """One forward of a job: on which target, for which runs."""

    target_id: int
    runs: list[str]


class SharedStream:
    """One producing side (targets, shared budget) over one `HSPool` per run."""

    def __init__(self, cfg: PoolConfig, num_buckets: int, runs: dict[str, RunShape], pull_policy: Any = None,
                 clock: Callable[[], float] = time.monotonic, broken_after: int = 3) -> None:
        assert runs, "a stream needs a run"
        self.cfg = cfg
        self.pools = {name: HSPool(cfg, num_buckets, pull_policy=pull_policy, clock=clock, ranks=shape.ranks,
                                   accum=shape.accum, broken_after=broken_after, on_change=self._wake)
                      for name, shape in runs.items()}
        self._shared = len(runs) > 1  # one run's own budget is the stream's: no gate, no shared tally
        if self._shared:
            for pool in self.pools.values():
                pool.stream_side().gate = self._fits_shared
        self._in_flight: dict[int, list[_Issue]] = {}  # job id -> its forwards in flight
        self._per_target: dict[int, int] = {}  # target id -> its forwards in flight (asked on every issue)
        self._held: dict[int, int] = {}  # job id -> bytes (reservation, then payload) while any run holds it
        self.forwards = 0  # target forwards issued (one per job and production, whatever the runs)
        self.forwards_by_runs: dict[int, int] = {}  # how many runs each forward fed -> forwards
        self._event = asyncio.Event()
        self._waking = False

    def pool(self, run: str) -> HSPool:
        return self.pools[run]

    # ---- jobs in: every run gets the same schedule ---------------------------------------------

    def add_jobs(self, jobs: Iterable[JobSpec]) -> int:
        jobs = list(jobs)
        return max(pool.add_jobs(jobs) for pool in self.pools.values())

    def add_epoch(self, jobs: EpochJobs, bytes_per_token: int = 0) -> int:
        return max(pool.add_epoch(jobs, bytes_per_token) for pool in self.pools.values())

    def finish_adding(self) -> None:
        for pool in self.pools.values():
            pool.finish_adding()

    # ---- the producing side (the pool actor's dispatch loop and PoolControl call these) -----------

    def next_job(self, target_id: int) -> JobSpec | None:
        """The next job for this target, issued to every run that still needs it; None when the target's
        slots are full, no run has a job, or the first job on offer does not fit a run that needs it."""
        if self.in_flight_count(target_id) >= self.cfg.jobs_in_flight_per_target:
            return None
        for pool in self.pools.values():
            job = pool.stream_side().candidate(target_id)
            if job is None:
                continue
            needers = [name for name, p in self.pools.items() if p.job_state(job.job_id) is JobState.PENDING]
            if not all(self.pools[name].stream_side().fits(job) for name in needers):
                continue  # a run that needs it is full: wait for it (another run's own job may still fit)
            for name in needers:
                self.pools[name].stream_side().issue(job, target_id)
            self._in_flight.setdefault(job.job_id, []).append(_Issue(target_id, needers))
            self._per_target[target_id] = self._per_target.get(target_id, 0) + 1
            if self._shared:  # the shared tally holds the largest reservation of the runs it feeds
                reserve = max(self.pools[name].stream_side().reservation(job) for name in needers)
                self._held[job.job_id] = max(self._held.get(job.job_id, 0), reserve)
            self.forwards += 1
            self.forwards_by_runs[len(needers)] = self.forwards_by_runs.get(len(needers), 0) + 1
            return job
        return None

    def job_done(self, target_id: int, meta: ItemMeta, payload: Any) -> bool:
        """The forward landed: its payload ref goes to every run it was issued for. False when stale."""
        issue = self._pop(target_id, meta.job_id)
        if issue is None:
            return False
        if self._shared:
            self._held[meta.job_id] = meta.nbytes
        landed = [self.pools[name].job_done(target_id, meta, payload) for name in issue.runs]
        return any(landed)

    def job_failed(self, target_id: int, job_id: int) -> bool:
        issue = self._pop(target_id, job_id)
        return issue is not None and any([self.pools[n].job_failed(target_id, job_id) for n in issue.runs])

    def job_raised(self, target_id: int, job_id: int, error: str) -> bool:
        issue = self._pop(target_id, job_id)
        return issue is not None and any([self.pools[n].job_raised(target_id, job_id, error) for n in issue.runs])

    @property
    def broken_after(self) -> int:
        return next(iter(self.pools.values())).broken_after

    def target_broken(self, target_id: int) -> bool:
        return any(pool.target_broken(target_id) for pool in self.pools.values())

    def target_added(self, target_id: int) -> None:
        for pool in self.pools.values():
            pool.target_added(target_id)

    def target_lost(self, target_id: int) -> list[int]:
        """The target died: its forwards go back to the front of every run's queue that was waiting for them."""
        for job_id in [j for j, issues in self._in_flight.items() if any(i.target_id == target_id for i in issues)]:
            self._pop(target_id, job_id)
        ids: set[int] = set()
        for pool in self.pools.values():
            ids.update(pool.target_lost(target_id))
        return sorted(ids)

    def in_flight_count(self, target_id: int) -> int:
        """Forwards on this target (one per job, whatever the runs it feeds)."""
        return self._per_target.get(target_id, 0)

    # ---- the shared budget ------------------------------------------------------------------------

    def held(self) -> tuple[int, int]:
        """(items, bytes) the stream holds, a ref shared by several runs counted once: items buffered or
        in flight in any run; bytes of jobs in flight, buffered or leased in any run."""
        items = total = 0
        for job_id in list(self._held):
            states = [pool.job_state(job_id) for pool in self.pools.values()]
            if not any(s in _HELD for s in states):
                del self._held[job_id]  # every run acked it (or gave it back): its ref is gone
                continue
            total += self._held[job_id]
            items += any(s in _COUNTED for s in states)
        return items, total

    def _fits_shared(self, reserve: int) -> bool:
        items, total = self.held()
        return items < self.cfg.capacity and total + reserve <= self.cfg.capacity_bytes

    # ---- done, change notification ----------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Every run acked every job (or quarantined it)."""
        return all(pool.done for pool in self.pools.values())

    async def wait_changed(self) -> None:
        await self._event.wait()

    def notify(self) -> None:
        self._wake()

    def _wake(self, source: HSPool | None = None) -> None:
        # The dispatch loop looks again; any run's change may free the shared budget for another, so the
        # other runs' waiting pulls look again too (a run that holds leases then drains; see
        # Production.stalled). `source` (the pool that changed) woke its own. Re-entered from their wakes.
        if self._waking:
            return
        self._waking = True
        try:
            ev, self._event = self._event, asyncio.Event()
            ev.set()
            for pool in self.pools.values():
                if pool is not source:
                    pool.notify()
        finally:
            self._waking = False

    def _pop(self, target_id: int, job_id: int) -> _Issue | None:
        issues = self._in_flight.get(job_id, [])
        issue = next((i for i in issues if i.target_id == target_id), None)
        if issue is not None:
            issues.remove(issue)
            self._per_target[target_id] -= 1
            if not issues:
                del self._in_flight[job_id]
        return issue


class PoolControl:
    """Targets (registered, paused, failed), the eval offer, the stop flag, step records, reports."""

    def __init__(self, pool: HSPool | SharedStream, unexported: int = 4096) -> None:
        """`pool`: the stream (for its targets) or a run's pool (for the rest). `unexported`: step records
        kept for the metrics exporter until it reads them (bounded: records reported before the exporter
        starts, or while it is stuck, must not pile up)."""
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
