"""The value checks every config section runs in its `__post_init__`: each failure is one ValueError
that starts with the dotted key and its value and says how to fix it."""
from __future__ import annotations

import math
from typing import Any, NoReturn


def fail(key: str, value: Any, problem: str) -> NoReturn:
    raise ValueError(f"{key}={value!r} {problem}")


def finite(key: str, value: float, fix: str) -> None:
    # nan passes every `<` test and inf every `>` one: a nan lr trains nan weights, a nan timeout never fires
    if isinstance(value, float) and not math.isfinite(value):
        fail(key, value, f"is not a finite number; {fix}")


def at_least(key: str, value: float, minimum: float, why: str) -> None:
    finite(key, value, f"set {key}={minimum} or more")
    if value < minimum:
        fail(key, value, f"must be >= {minimum} ({why}); set {key}={minimum} or more")


def positive(key: str, value: float, unit: str = "") -> None:
    finite(key, value, f"set a number > 0{unit}")
    if value <= 0:
        fail(key, value, f"must be > 0{unit}")


def one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        fail(key, value, f"is not one of {', '.join(allowed)}; pick one of them")
