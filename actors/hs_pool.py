"""HSPoolActor: the async Ray actor around the pure pool policy (app/pool/hs_pool.py).

Launch it with `ray.remote(HSPoolActor).options(max_concurrency=pool_max_concurrency(...))`.

Why it calls the targets itself: a ref that a target `ray.put`s dies with that target
(OwnerDiedError). The pool calls `target.forward.options(num_returns=2).remote(job)`, so the pool's
process owns both returned refs (meta, payload) and they outlive the target. The pool awaits only
the small meta ref and never fetches a payload.

Concurrency: everything runs on the actor's one asyncio loop (one concurrency group), so every
asyncio primitive of the policy lives in that loop. Only incoming calls hold concurrency slots;
target results are awaited by internal tasks that hold none. Blocked pulls do hold slots, so
`max_concurrency` must exceed the number of pulls that can wait at once (each drafter waits in at
most a couple: its pull and its prefetch) plus room for acks, stats, step reports and job adds;
`pool_max_concurrency` sizes it with a wide margin. A pull still waiting when its drafter dies is
not cancelled by Ray; `release(drafter)` fences it (it raises LeaseRevoked and takes nothing).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from typing import Any

from app.config.schema import PoolConfig
from app.data.schedule import EpochJobs
from app.messages import EndOfStream, ItemMeta, JobSpec, PulledItem, StepRecord, TargetFailure
from app.pool.hs_pool import Drained, HSPool
from app.pool.pull_policy import PullPolicy
from app.pool.stats import PoolStats

log = logging.getLogger(__name__)


def pool_max_concurrency(num_targets: int, num_drafters: int) -> int:
    """Concurrency slots for the pool actor: 16 per actor that talks to it, at least 128.

    Waiting pulls are at most ~2 per drafter (pull + prefetch), plus fenced pulls of dead
    drafters until they wake; everything else returns at once. 16x leaves the wake-up calls
    (acks, adds, stats) free slots even if every drafter misbehaves and piles up pulls.
    """
    return max(128, 16 * (num_targets + num_drafters))


class HSPoolActor:
    """Shared job queue, per-bucket payload refs, bucket-fair pulls, leases, metrics hub."""

    def __init__(
        self,
        pool_cfg: PoolConfig,
        num_buckets: int,
        run_name: str,
        pull_policy: str | PullPolicy | None = None,
        ranks: int | None = None,
        accum: int = 1,
    ) -> None:
        """`pull_policy` None = pool_cfg.pull_policy; `ranks` x `accum` (drafters x train.grad_accum)
        is one global step, which the stratified policy mixes."""
        self._cfg = pool_cfg
        self._pool = HSPool(pool_cfg, num_buckets, pull_policy=pull_policy, ranks=ranks, accum=accum)
        self._run_name = run_name
        self._targets: dict[int, Any] = {}
        self._failures: list[TargetFailure] = []
        self._steps: deque[StepRecord] = deque(maxlen=4096)
        self._undrained: list[StepRecord] = []
        self._waits: list[float] = []  # pull waits since the last metrics tick
        self._tasks: set[asyncio.Task] = set()
        self._started = False
        self._metrics: Any = None
        self._stop_requested = False
        # Live evaluation (eval.every_steps): rank 0 offers its weights, the driver takes the newest
        # and runs it on one target, which gets no training jobs meanwhile (paused).
        self._eval_offer: tuple[int, list] | None = None
        self._paused: set[int] = set()

    # ---- lifecycle ------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        # Background tasks need the actor's running loop, which __init__ does not have.
        if self._started:
            return
        self._started = True
        self._spawn(self._dispatch_loop())
        self._spawn(self._metrics_loop())

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # keep a strong ref; asyncio holds tasks weakly
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # never lose a loop silently
            log.error("pool background task failed", exc_info=task.exception())

    # ---- targets --------------------------------------------------------------------------

    async def add_target(self, target_id: int, handle: Any) -> None:
        """Register (or replace after a restart) a target; it gets jobs at once."""
        self._ensure_started()
        if self._pool.in_flight_count(target_id):
            self._pool.target_lost(target_id)  # the old incarnation's jobs go back to the queue
        self._targets[target_id] = handle
        self._pool.notify()

    async def target_failures(self) -> list[TargetFailure]:
        """One line per target failure seen (target, job, error), oldest first."""
        return list(self._failures)

    async def _dispatch_loop(self) -> None:
        while True:
            for tid, handle in list(self._targets.items()):
                while tid in self._targets and tid not in self._paused and (job := self._pool.next_job(tid)) is not None:
                    self._launch(tid, handle, job)
            await self._pool.wait_changed()

    def _launch(self, tid: int, handle: Any, job: JobSpec) -> None:
        try:
            meta_ref, payload_ref = handle.forward.options(num_returns=2).remote(job)
        except Exception as e:  # noqa: BLE001 - a broken handle must not kill the dispatch loop
            self._on_target_error(tid, handle, job, e)
            return
        self._spawn(self._await_result(tid, handle, job, meta_ref, payload_ref))

    async def _await_result(self, tid: int, handle: Any, job: JobSpec, meta_ref: Any, payload_ref: Any) -> None:
        from ray.exceptions import RayError

        try:
            meta: ItemMeta = await meta_ref
        except RayError as e:  # the actor died (RayActorError) or forward raised (RayTaskError)
            self._on_target_error(tid, handle, job, e)
            return
        self._pool.job_done(tid, meta, payload_ref)

    def _on_target_error(self, tid: int, handle: Any, job: JobSpec, err: Exception) -> None:
        # Only the registered incarnation counts: when a target was removed or replaced, its
        # in-flight jobs were re-queued then, and the job id may now run on the new incarnation.
        from ray.exceptions import RayActorError, RayTaskError

        if self._targets.get(tid) is handle:
            lines = [l for l in str(err).strip().splitlines() if l.strip()]
            if isinstance(err, RayTaskError) and not isinstance(err, RayActorError):
                # forward raised but the target lives: only the job failed (twice: quarantined).
                self._pool.job_raised(tid, job.job_id, f"{lines[-1][:300] if lines else type(err).__name__}")
                return
            self._pool.job_failed(tid, job.job_id)
            del self._targets[tid]
            self._pool.target_lost(tid)
            first_line = (lines or [""])[0][:300]
            self._failures.append(TargetFailure(tid, job.job_id, f"{type(err).__name__}: {first_line}"))

    # ---- jobs -----------------------------------------------------------------------------

    async def add_jobs(self, jobs: list[JobSpec]) -> int:
        """Queue these JobSpecs as given (tests, benches); a run adds whole epochs (`add_epoch`)."""
        self._ensure_started()
        return self._pool.add_jobs(jobs)

    async def add_epoch(self, jobs: EpochJobs, bytes_per_token: int = 0) -> int:
        """Queue one epoch's schedule (see HSPool.add_epoch). Send it as a `ray.put` ref: Ray resolves
        it here with its arrays zero-copy in the object store, so they add nothing to the pool's heap."""
        self._ensure_started()
        return self._pool.add_epoch(jobs, bytes_per_token)

    async def finish_adding(self) -> None:
        self._pool.finish_adding()

    async def restore_ledger(self, job_ids: list[int]) -> None:
        self._pool.restore_ledger(job_ids)

    # ---- drafters -------------------------------------------------------------------------

    async def pull(self, drafter_id: int, generation: int = 0,
                   acks: list[int] | None = None) -> PulledItem | EndOfStream | Drained:
        """Ack `acks` (the drafter's last step rides on its next pull: one call), then lease the next
        item, waiting for the reservoir; see app.pool.hs_pool.HSPool.pull."""
        self._ensure_started()
        t0 = time.monotonic()
        got = await self._pool.pull(drafter_id, generation, acks or ())
        if isinstance(got, PulledItem):
            self._waits.append(time.monotonic() - t0)
        return got

    async def pull_many(self, drafter_id: int, n: int, generation: int = 0,
                        acks: list[int] | None = None) -> list[PulledItem | EndOfStream | Drained]:
        """Acks, then up to n pulls in one call: waits for the first, then takes what is ready now."""
        first = await self.pull(drafter_id, generation, acks)
        out = [first]
        while len(out) < n and isinstance(out[-1], PulledItem):
            got = self._pool.try_pull(drafter_id)
            if not isinstance(got, PulledItem):
                break
            out.append(got)
        return out

    async def ack(self, drafter_id: int, job_ids: list[int], generation: int | None = None) -> int:
        return self._pool.ack(drafter_id, job_ids, generation)

    async def payload_lost(self, drafter_id: int, job_id: int, generation: int | None = None) -> bool:
        """See HSPool.payload_lost: re-issue one job whose hidden states were lost with a node."""
        return self._pool.payload_lost(drafter_id, job_id, generation)

    async def generation(self, drafter_id: int) -> int:
        return self._pool.generation(drafter_id)

    async def release(self, drafter_id: int) -> list[int]:
        return self._pool.release(drafter_id)

    async def reset_drafters(self) -> list[int]:
        return self._pool.reset_drafters()

    async def set_ranks(self, ranks: int | None) -> None:
        """A rebuilt drafter group of another size: see HSPool.set_ranks."""
        self._pool.set_ranks(ranks)

    async def rollback(self, keep_ids: list[int]) -> int:
        """Drafter group rebuilt from a checkpoint: see HSPool.rollback."""
        return self._pool.rollback(keep_ids)

    async def request_stop(self) -> None:
        """The driver got SIGTERM: drafter rank 0 sees this and the group checkpoints and returns."""
        self._stop_requested = True

    async def stop_requested(self) -> bool:
        return self._stop_requested

    async def ledger(self) -> list[int]:
        return self._pool.ledger()

    # ---- telemetry ------------------------------------------------------------------------

    async def report_step(self, rec: StepRecord) -> None:
        self._pool.record_step(rec.step, rec.job_ids)
        self._steps.append(rec)
        self._undrained.append(rec)
        if self._metrics is not None:
            self._metrics.step(rec)

    async def report_restart(self, kind: str) -> None:
        """The driver restarted a target (`target`) or rebuilt the drafters (`drafter_group`)."""
        if self._metrics is not None:
            self._metrics.restart(kind)

    async def offer_eval(self, step: int, weights: list) -> None:
        """Rank 0's weights at `step` (`[ref]`: the list keeps Ray from resolving it here); a newer
        offer replaces one not yet taken, so evaluation never queues up behind training."""
        self._eval_offer = (step, weights)

    async def take_eval(self) -> tuple[int, list] | None:
        """The newest offered weights, once (the driver's evaluation runner)."""
        offer, self._eval_offer = self._eval_offer, None
        return offer

    async def pause_target(self, target_id: int) -> None:
        """Issue no training jobs to this target (it evaluates); the ones it holds finish."""
        self._paused.add(target_id)

    async def resume_target(self, target_id: int) -> None:
        self._paused.discard(target_id)
        self._pool.notify()

    async def report_tau(self, step: int, tau: float) -> None:
        """An evaluation's tau, for the `dflash_tau` gauge."""
        if self._metrics is not None:
            self._metrics.evaluation(tau)

    async def drain_step_records(self) -> list[StepRecord]:
        """Step records reported since the previous drain (for the driver's logging)."""
        out, self._undrained = self._undrained, []
        return out

    async def pull_policy(self) -> PullPolicy:
        """The pull policy object as it is now (benches read what their own policies recorded)."""
        return self._pool.policy

    async def stats(self) -> PoolStats:
        return self._stats()

    def _stats(self) -> PoolStats:
        return dataclasses.replace(
            self._pool.stats(), target_failures=list(self._failures), targets=sorted(self._targets)
        )

    async def _metrics_loop(self) -> None:
        from actors.pool_metrics import PoolMetrics

        self._metrics = PoolMetrics(self._run_name)
        for rec in self._steps:
            self._metrics.step(rec)
        while True:
            waits, self._waits = self._waits, []
            self._metrics.tick(self._pool.stats(), waits)
            await asyncio.sleep(self._cfg.metrics_every_s)
