"""One run's view of the stream's pool actor and of its placement group, for every run (a single run is one
named "").

`RunScoped` wraps the pool actor's handle: every drafter-side call (pull, ack, the stop flag, eval
offers, step records, rollbacks, stats) gets `run=<name>`, the rest (targets, jobs) goes as is. The
drafter ranks and the run's `PoolClient` hold it in place of the raw handle. `RunTopology` gives a run its
own slice of the drafter bundles (a single run's: all of them), which its elastic changes move.
"""
from __future__ import annotations

from typing import Any

PER_RUN = frozenset({"pull", "ack", "payload_lost", "generation", "release", "set_ranks", "rollback", "ledger",
                     "request_stop", "clear_stop", "stop_requested", "offer_eval", "take_eval", "report_step",
                     "report_restart", "report_tau", "drain_step_records", "stats", "restore_ledger",
                     "pause_target", "resume_target"})  # a target another run evaluates on stays paused


class _RunMethod:
    """A pool method whose calls name the run."""

    def __init__(self, method: Any, run: str) -> None:
        self.method, self.run = method, run

    def remote(self, *args, **kwargs):
        return self.method.remote(*args, run=self.run, **kwargs)

    def options(self, **options) -> _RunMethod:
        return _RunMethod(self.method.options(**options), self.run)


class RunScoped:
    """The stream's pool actor as one of its runs sees it (picklable: drafter ranks receive it)."""

    def __init__(self, handle: Any, run: str) -> None:
        self.handle, self.run = handle, run

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("handle", "run"):  # pickling's lookups, and before __init__ ran
            raise AttributeError(name)
        method = getattr(self.handle, name)
        return _RunMethod(method, self.run) if name in PER_RUN else method


class RunTopology:
    """The run's view of the stream's Topology: its own drafter bundles, everything else shared."""

    def __init__(self, topo: Any, bundles: list[int]) -> None:
        self._topo, self.drafter_bundles = topo, list(bundles)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._topo, name)

    def make_drafters(self, setup: Any, pool: Any, bundles: list[int] | None = None) -> list[Any]:
        return self._topo.make_drafters(setup, pool, list(bundles) if bundles else self.drafter_bundles)
