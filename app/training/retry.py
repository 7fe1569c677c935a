"""Transient object-store errors retried with exponential backoff, where payloads are put and fetched.

On a busy cluster a `ray.get` of a payload or a `ray.put` of rank 0's evaluation weights can fail for a
moment and then work: the store is full while spilling catches up (`ObjectStoreFullError`), a fetch from
another node timed out (`ObjectFetchTimedOutError`), a raylet call failed (`RpcError`). Without a retry
the first costs an evaluation, the second sends a job back to be recomputed as if its node had died,
and a rank that raises is a drafter death (the group rebuilt from the last checkpoint). Anything else
is raised at once: an `ObjectLostError` proper means the payload is gone, and waiting brings nothing back.
When the retries are spent the last error is raised, and the caller's own handling applies (a
timed-out fetch is an `ObjectLostError`: the job goes back to the queue).

The retrying is tenacity's (`Retrying`: stop after `attempts`, exponential waits, only the transient
classes); what is ours is the policy (which errors, how long) and the hook that logs each retry. The
callable, the error classes and the sleep are arguments (tests pass a fake and a recording sleep);
`transient_object_errors()` names Ray's classes.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """`attempts` calls at most; the waits between them start at `first_s` and grow by `factor`, each
    at most `max_s` (defaults: 0.5, 1, 2, 4, 8 s, about 15 s in all: what a spill or a slow node needs)."""

    attempts: int = 6
    first_s: float = 0.5
    factor: float = 2.0
    max_s: float = 8.0


def transient_object_errors() -> tuple[type[BaseException], ...]:
    """Ray's object-store errors that pass if tried again."""
    from ray.exceptions import ObjectFetchTimedOutError, ObjectStoreFullError, RpcError

    return ObjectStoreFullError, ObjectFetchTimedOutError, RpcError


def with_retries(call: Callable[[], T], transient: tuple[type[BaseException], ...], backoff: Backoff = Backoff(),
                 sleep: Callable[[float], None] = time.sleep,
                 on_retry: Callable[[int, BaseException, float], None] | None = None) -> T:
    """`call()`, tried again after each `transient` error with the backoff's waits; `on_retry(attempt,
    error, wait)` is told of each. Other errors, and the last transient one, are raised."""
    from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

    def told(state) -> None:
        if on_retry is not None:
            on_retry(state.attempt_number, state.outcome.exception(), state.next_action.sleep)

    retrying = Retrying(stop=stop_after_attempt(backoff.attempts), sleep=sleep, reraise=True, before_sleep=told,
                        wait=wait_exponential(multiplier=backoff.first_s, exp_base=backoff.factor, max=backoff.max_s),
                        retry=retry_if_exception_type(transient))
    return retrying(call)
