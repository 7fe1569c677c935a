"""Which bucket the next pull takes from. The pool takes a uniformly random item within it.

A policy sees the buffered counts per bucket (never empty when asked) and the pulling drafter.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol


class PullPolicy(Protocol):
    name: str

    def choose(self, drafter_id: int, counts: Sequence[int], rng: random.Random) -> int:
        """A bucket with counts[bucket] > 0."""

    def reset(self) -> None:
        """The drafter group is rebuilt: forget per-drafter state."""


class RoundRobin:
    """Per drafter, the next non-empty bucket after the last one it got: every non-empty bucket is
    served at the same rate, whatever share of the data it holds."""

    name = "round_robin"

    def __init__(self, num_buckets: int) -> None:
        self.num_buckets = num_buckets
        self._cursor: dict[int, int] = {}  # drafter -> last bucket served

    def choose(self, drafter_id: int, counts: Sequence[int], rng: random.Random) -> int:
        last = self._cursor.get(drafter_id, -1)
        for step in range(1, self.num_buckets + 1):
            b = (last + step) % self.num_buckets
            if counts[b]:
                self._cursor[drafter_id] = b
                return b
        raise AssertionError("choose called with every bucket empty")

    def reset(self) -> None:
        self._cursor.clear()


POLICIES = {RoundRobin.name: RoundRobin}


def make_pull_policy(policy: "str | PullPolicy", num_buckets: int) -> PullPolicy:
    """A policy by name (the config's choice), or an instance as given (benches bring their own)."""
    if isinstance(policy, str):
        return POLICIES[policy](num_buckets)
    return policy
