"""HSPoolActor: the async Ray actor around the pure pool (app/pool/stream.py: the stream over the runs'
HSPools of app/pool/hs_pool.py, and the control state: targets, pauses, eval offers, the stop flag, step
records). What remains here is Ray: the calls in, the dispatch loop that launches target forwards, the
metrics loop.

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

One road for one run and for a sweep: the targets always feed a `SharedStream` (app/pool/stream.py)
with one HSPool and one PoolControl (stop flag, eval offers, step records) per run; the stream's own
PoolControl holds the targets. A single run is a stream of one run, named "" (every call's default
`run`); the runs of a sweep (`runs=`) are named, and every drafter-side call of theirs names its run
(`run=`, which the `RunScoped` handle of app/run/supervise/run_scoped.py adds).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from app.config.schema import PoolConfig
from app.data.schedule import EpochJobs
from app.messages import EndOfStream, ItemMeta, JobSpec, PulledItem, StepRecord
from app.pool.hs_pool import Drained, HSPool
from app.pool.pull_policy import PullPolicy
from app.pool.stream import PoolControl, RunShape, SharedStream
from app.pool.telemetry import PoolStats

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
        runs: dict[str, RunShape] | None = None,
        broken_after: int = 3,
    ) -> None:
        """`pull_policy` None = pool_cfg.pull_policy; `broken_after` = supervision.broken_target_raises (see
        app/pool/sides.py). `runs`: each run's shape by name, its ranks x grad_accum one global step, which
        the stratified policy mixes (a single run is one named "": app/run/topology.py); None = one run
        named "" whose ranks are as many as pull (tests and benches that need no global step)."""
        self._cfg = pool_cfg
        shapes = runs or {"": RunShape(None)}
        self._stream = SharedStream(pool_cfg, num_buckets, shapes, pull_policy=pull_policy, broken_after=broken_after)
        self._runs = {name: PoolControl(pool) for name, pool in self._stream.pools.items()}
        self._control = PoolControl(self._stream)  # the targets: registered, paused, failed
        self._run_name = run_name
        self._tasks: set[asyncio.Task] = set()
        self._started = False

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
        self._control.add_target(target_id, handle)

    async def remove_target(self, target_id: int) -> list[int]:
        """A re-split retires this target: see PoolControl.remove_target."""
        return self._control.remove_target(target_id)

    async def pause_target(self, target_id: int, run: str = "") -> None:
        """Issue no training jobs to this target (it evaluates); the ones it holds finish. Several runs on
        one stream: it trains again once every run that paused it resumed it."""
        self._control.pause(target_id, run)

    async def resume_target(self, target_id: int, run: str = "") -> None:
        self._control.resume(target_id, run)

    async def _dispatch_loop(self) -> None:
        while True:
            for tid, handle in self._control.targets():
                while (job := self._control.next_job(tid, handle)) is not None:
                    self._launch(tid, handle, job)
            await self._stream.wait_changed()

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
        self._stream.job_done(tid, meta, payload_ref)

    def _on_target_error(self, tid: int, handle: Any, job: JobSpec, err: Exception) -> None:
        from ray.exceptions import RayActorError, RayTaskError

        if isinstance(err, RayTaskError) and not isinstance(err, RayActorError):  # forward raised, target lives
            self._control.target_raised(tid, handle, job.job_id, type(err).__name__, str(err))
        else:
            self._control.target_died(tid, handle, job.job_id, type(err).__name__, str(err))

    # ---- jobs -----------------------------------------------------------------------------

    async def add_jobs(self, jobs: list[JobSpec]) -> int:
        """Queue these JobSpecs as given (tests, benches); a run adds whole epochs (`add_epoch`)."""
        self._ensure_started()
        return self._stream.add_jobs(jobs)

    async def add_epoch(self, jobs: EpochJobs, bytes_per_token: int = 0) -> int:
        """Queue one epoch's schedule (see HSPool.add_epoch). Send it as a `ray.put` ref: Ray resolves
        it here with its arrays zero-copy in the object store, so they add nothing to the pool's heap."""
        self._ensure_started()
        return self._stream.add_epoch(jobs, bytes_per_token)

    async def finish_adding(self) -> None:
        self._stream.finish_adding()

    async def restore_ledger(self, job_ids: list[int], run: str = "") -> None:
        self._hs(run).restore_ledger(job_ids)

    # ---- drafters -------------------------------------------------------------------------

    async def pull(self, drafter_id: int, generation: int = 0,
                   acks: list[int] | None = None, run: str = "") -> PulledItem | EndOfStream | Drained:
        """Ack `acks` (the drafter's last step rides on its next pull: one call), then lease the next
        item, waiting for the reservoir; see app.pool.hs_pool.HSPool.pull (which times the wait)."""
        self._ensure_started()
        return await self._hs(run).pull(drafter_id, generation, acks or ())

    async def ack(self, drafter_id: int, job_ids: list[int], generation: int | None = None, run: str = "") -> int:
        return self._hs(run).ack(drafter_id, job_ids, generation)

    async def payload_lost(self, drafter_id: int, job_id: int, generation: int | None = None, run: str = "") -> bool:
        """See HSPool.payload_lost: re-issue one job whose hidden states were lost with a node."""
        return self._hs(run).payload_lost(drafter_id, job_id, generation)

    async def generation(self, drafter_id: int, run: str = "") -> int:
        return self._hs(run).generation(drafter_id)

    async def release(self, drafter_id: int, run: str = "") -> list[int]:
        return self._hs(run).release(drafter_id)

    async def set_ranks(self, ranks: int | None, run: str = "") -> None:
        """A rebuilt drafter group of another size: see HSPool.set_ranks."""
        self._hs(run).set_ranks(ranks)

    async def rollback(self, keep_ids: list[int], run: str = "") -> int:
        """Drafter group rebuilt from a checkpoint: see HSPool.rollback."""
        return self._hs(run).rollback(keep_ids)

    async def ledger(self, run: str = "") -> list[int]:
        return self._hs(run).ledger()

    async def stream_counts(self) -> dict:
        """Target forwards issued, and how many runs each fed (a single run's all fed one)."""
        return {"forwards": self._stream.forwards, "forwards_by_runs": dict(self._stream.forwards_by_runs)}

    def _hs(self, run: str) -> HSPool:
        """The HSPool a drafter-side call is about: its run's."""
        return self._runs[run].pool

    def _ctl(self, run: str) -> PoolControl:
        return self._runs[run]

    # ---- the driver's controls ------------------------------------------------------------

    async def request_stop(self, run: str = "") -> None:
        """The driver got SIGTERM: drafter rank 0 sees this and the group checkpoints and returns."""
        self._ctl(run).request_stop()

    async def clear_stop(self, run: str = "") -> None:
        """After a re-split's checkpoint: the rebuilt group trains on."""
        self._ctl(run).clear_stop()

    async def stop_requested(self, run: str = "") -> bool:
        return self._ctl(run).stop_requested

    async def offer_eval(self, step: int, weights: list, run: str = "") -> None:
        """Rank 0's weights at `step` (`[ref]`: the list keeps Ray from resolving it here); a newer
        offer replaces one not yet taken, so evaluation never queues up behind training."""
        self._ctl(run).offer_eval(step, weights)

    async def take_eval(self, run: str = "") -> tuple[int, list] | None:
        """The newest offered weights, once (the driver's evaluation runner)."""
        return self._ctl(run).take_eval()

    # ---- telemetry ------------------------------------------------------------------------

    async def report_step(self, rec: StepRecord, run: str = "") -> None:
        self._ctl(run).report_step(rec)

    async def report_restart(self, kind: str, run: str = "") -> None:
        """The driver restarted a target (`target`) or rebuilt the drafters (`drafter_group`)."""
        self._ctl(run).report_restart(kind)

    async def report_tau(self, step: int, tau: float, run: str = "", health: dict | None = None) -> None:
        """An evaluation's tau, for the `dflash_tau` gauge, and its learning checks for `dflash_health{check}` and
        `dflash_health_verdict{verdict}` (`{"checks": {name: value}, "verdicts": [names]}`, None = none)."""
        self._ctl(run).report_tau(tau, health)

    async def drain_step_records(self, run: str = "") -> list[StepRecord]:
        """Step records reported since the previous drain (for the driver's logging)."""
        return self._ctl(run).drain_step_records()

    async def stats(self, run: str = "") -> PoolStats:
        """The run's snapshot, with the stream's target fields."""
        return self._runs[run].stats(targets=self._control)

    async def _metrics_loop(self) -> None:
        from actors.pool_metrics import PoolMetrics

        runs = {name: PoolMetrics(self._run_name, name) for name in self._runs}  # "": no drafter_run label
        while True:
            for run, metrics in runs.items():
                for rec in self._ctl(run).take_unexported():
                    metrics.step(rec)
                metrics.tick(await self.stats(run), self._hs(run).drain_pull_waits())
            await asyncio.sleep(self._cfg.metrics_every_s)
