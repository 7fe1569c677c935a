"""The pure deciders of one run's split and size, built from its config before anything starts.

The run's monitor (app/run/outputs/monitor.py) shows them on the status line and puts them in summary.json;
the Ray shells (`resplit_shell.py`, `grow_shell.py`, `extra_shell.py`) feed and follow them once the
actors are up. Both are handed the same objects, built here in one place.
"""
from __future__ import annotations

from dataclasses import dataclass

from app.run.elastic.advisor import SplitAdvisor
from app.run.elastic.extra import ExtraPlanner
from app.run.elastic.grow import GrowthPlanner
from app.run.elastic.resplit import Rebalancer


@dataclass(frozen=True)
class Planners:
    """The split advisor, the re-split trigger, the growth planner and the extra-GPU planner of one run."""

    advisor: SplitAdvisor
    rebalancer: Rebalancer
    growth: GrowthPlanner
    extra: ExtraPlanner

    @classmethod
    def for_run(cls, cfg) -> "Planners":
        """From the run's `Config`: the topology section (and faults.virtual_clock for the advisor)."""
        return cls(SplitAdvisor.for_run(cfg), Rebalancer.for_topology(cfg.topology), GrowthPlanner(),
                   ExtraPlanner.for_topology(cfg.topology))
