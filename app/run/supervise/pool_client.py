"""The pool actor behind plain method calls, as `ray.util.queue.Queue` wraps its actor.

Every call the driver makes to HSPoolActor goes through `PoolClient`: a waited call returns the
pool's answer. Ray raises ActorUnavailableError for a connection that blips (seen once in four
node-loss runs) without saying whether the call ran, so only the calls that are safe to send twice
are retried, after a pause that doubles each time. A pool that died or stays silent raises `PoolDied`
(a `RunFailed`: one line saying where a resubmission resumes from); the supervisor recreates the pool
while `supervision.max_restarts_pool` lasts (`recreate` makes the new actor once the dead one's name is
free; `replace` swaps the handle every helper reaches it by).
"""
from __future__ import annotations

import time
from typing import Any, Callable

from app.run.supervise.events import RunFailed

CALL_TIMEOUT_S = 60.0  # a live pool answers in milliseconds; a minute of silence means it is gone
RETRIES = 5  # for idempotent calls only
BACKOFF_S = 0.5  # the first pause; doubled per retry (0.5 + 1 + 2 + 4 + 8 = 15.5 s at most)
NAME_FREE_S = 30.0  # how long a recreated pool waits for the dead one's actor name to be released

# Calls that change nothing when they run twice: a retry after an unknown outcome is safe.
IDEMPOTENT = frozenset({"stats", "ledger", "request_stop", "finish_adding", "pause_target", "resume_target", "set_ranks",
                        "clear_stop", "remove_target"})


class PoolDied(RunFailed):
    """The pool actor died or stopped answering; the message is the run's one line if it is not recreated."""


class PoolClient:
    """The HSPoolActor handle with one method per remote call the driver makes (names as the pool's)."""

    def __init__(self, handle: Any, checkpoint_dir: str, get: Callable | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.handle = handle  # the raw actor handle: the drafters call the pool themselves
        self.checkpoint_dir = checkpoint_dir
        self._get, self._sleep = get, sleep  # injectable: tests drive the retries without a cluster

    def replace(self, handle: Any) -> None:
        """A recreated pool: every later call (targets, drafter group, evaluations) goes to `handle`."""
        self.handle = handle

    def recreate(self, make_pool: Callable[[], Any], clock: Callable[[], float]) -> None:
        """A pool actor from `make_pool` in the dead one's place (a silent one is killed first: its name must
        be free), then `replace`d. Raises RunFailed when the name stays taken for NAME_FREE_S."""
        import ray

        ray.kill(self.handle, no_restart=True)
        deadline = clock() + NAME_FREE_S
        while True:
            try:
                self.replace(make_pool())
                return
            except ValueError as exc:  # the name is still taken: the GCS has not released it yet
                if clock() > deadline:
                    raise RunFailed(f"the pool could not be recreated ({exc}); resubmit the same command to "
                                    "resume from the latest checkpoint") from None
                self._sleep(0.5)

    # ---- waited calls ----------------------------------------------------------------------

    def restore_ledger(self, ledger: list[int]) -> None:
        return self._call("restore_ledger", ledger)

    def add_epoch(self, epoch_ref: Any, bytes_per_token: int) -> None:
        return self._call("add_epoch", epoch_ref, bytes_per_token)

    def finish_adding(self) -> None:
        return self._call("finish_adding")

    def add_target(self, target_id: int, handle: Any) -> None:
        return self._call("add_target", target_id, handle)

    def stats(self):
        return self._call("stats")

    def ledger(self) -> list[int]:
        """The job ids acked so far (a finished run's, for a recreated pool to restore)."""
        return self._call("ledger")

    def drain_step_records(self) -> list:
        return self._call("drain_step_records")

    def rollback(self, ledger: list[int]) -> int:
        """Jobs trained after the checkpoint whose `ledger` this is go back to the queue; returns their count."""
        return self._call("rollback", ledger)

    def set_ranks(self, ranks: int) -> None:
        return self._call("set_ranks", ranks)

    def request_stop(self) -> None:
        return self._call("request_stop")

    def clear_stop(self) -> None:
        return self._call("clear_stop")

    def remove_target(self, target_id: int) -> list[int]:
        return self._call("remove_target", target_id)

    def take_eval(self) -> tuple[int, Any] | None:
        return self._call("take_eval")

    def pause_target(self, target_id: int) -> None:
        return self._call("pause_target", target_id)

    def resume_target(self, target_id: int) -> None:
        return self._call("resume_target", target_id)

    # ---- fire and forget (metrics only: a lost one costs nothing) -------------------------

    def report_restart(self, what: str) -> None:
        self.handle.report_restart.remote(what)

    def report_tau(self, step: int, tau: float, health: dict | None = None) -> None:
        """`health`: the evaluation's checks as gauges (app/run/evaluate/schedule.py health_gauges)."""
        self.handle.report_tau.remote(step, tau, health=health)

    # ---- the one place a pool call waits ---------------------------------------------------

    def _call(self, name: str, *args) -> Any:
        import ray
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        get = self._get or ray.get
        retries = RETRIES if name in IDEMPOTENT else 0
        for attempt in range(retries + 1):
            try:
                return get(getattr(self.handle, name).remote(*args), timeout=CALL_TIMEOUT_S)
            except ActorUnavailableError as exc:
                if attempt == retries:
                    raise self._dead(exc) from None
                self._sleep(BACKOFF_S * 2**attempt)
            except (RayActorError, GetTimeoutError) as exc:
                raise self._dead(exc) from None
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _dead(self, exc: BaseException) -> PoolDied:
        from app.training.checkpoint import latest_checkpoint

        ckpt = latest_checkpoint(self.checkpoint_dir)
        return PoolDied(f"pool actor HSPoolActor died ({type(exc).__name__}); the run stops here. Resubmit the "
                         f"same command to resume from {ckpt or 'the start (no checkpoint yet)'}")
