"""One drafter run on a stream: its group, the drafter half of the decisions, its elastic changes, its outcome.

A stream (app/run/supervisor.py) drives one `RunSupervisor` per run, a single run included (named ""). Each
holds what is its own: its plan and monitor, a run-scoped pool client (`RunScoped`: every drafter-side call
names the run, "" for a single run), its `DrafterGroup` in its slice of the drafter bundles (`RunTopology`),
its `DrafterPolicy` (group rebuild budget, drafter stall watchdog, stop deadline: app/run/supervise/policy.py)
and, when its planners are given, the elastic shells that change its group while it trains (app/run/elastic/:
re-split, growth, extra GPUs), each handed the parts it uses. A crash or stall rebuilds this run's group only
and rolls back this run's ledger: the latest checkpoint's jobs stay, the rest are produced again.
Stop (SIGTERM): the pool tells rank 0, the group checkpoints at the next step boundary and returns. At the
end, `evaluate` measures tau with the code of the evaluations during the run (app/run/evaluate/final_tau.py).
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from app.model.drafter_tau import stop_token
from app.run.elastic.extra_shell import ExtraGpus
from app.run.elastic.grow_shell import Grower
from app.run.elastic.planners import Planners
from app.run.elastic.resplit_shell import Resplitter
from app.run.evaluate.final_tau import FinalTau, TauResult
from app.run.evaluate.schedule import eval_spec
from app.run.outputs.monitor import RunMonitor
from app.run.plan import RunPlan
from app.run.supervise.drafters import BundleWaits, DrafterGroup
from app.run.supervise.events import Fail, RebuildDrafters, RecreatePool, RequestStop, RunFailed, StopSignal
from app.run.supervise.policy import DrafterPolicy, TargetPolicy
from app.run.supervise.pool_client import PoolClient
from app.run.supervise.pool_watch import PoolWatch
from app.run.supervise.targets import Targets


@dataclass
class Outcome:
    """How the supervised run ended."""

    stopped: bool = False
    steps: int = 0
    drafter_results: list[Any] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=lambda: {"target": 0, "drafter_group": 0})


@dataclass(frozen=True)
class StreamParts:
    """What a run uses of its stream once the stream has started: the fleet and the target half of the policy
    (the elastic shells move targets), the bundle waits of a rebuild, and the live-target query (evaluations)."""

    fleet: Targets
    target_policy: TargetPolicy
    bundles: BundleWaits
    alive_targets: Callable[[], list[tuple[int, Any]]]


class RunSupervisor:
    """One run's drafter group, observed each turn of its stream, and the drafter half of the decisions."""

    def __init__(self, name: str, plan: RunPlan, monitor: RunMonitor, stop: threading.Event, log=print,
                 clock=time.monotonic, planners: Planners | None = None) -> None:
        """`name`: "" for a single run; `planners`: the deciders of the elastic changes, the same the monitor was
        built with, or None for a run whose group does not change while it trains (a run of a sweep)."""
        self.name, self.plan, self.cfg, self.monitor, self.stop_event = name, plan, plan.cfg, monitor, stop
        self.log, self.clock, self.planners = log, clock, planners
        self.policy = DrafterPolicy(self.cfg.supervision, now=clock())
        self.outcome = Outcome()
        self.watch = PoolWatch(self.cfg.pool.min_ready)  # whether this run's pool could serve a pull now
        self.last_status = 0.0
        self.on_status: Callable[[dict], None] | None = None  # the run's wandb logger (app/run/finish.py)
        # Every tau of the run decodes with this one spec, the EOS of the target included.
        self.eval_spec = eval_spec(plan, stop_token(plan.info.eos_token_ids))
        self.pool: PoolClient | None = None
        self.group: DrafterGroup | None = None
        self.alive_targets: Callable[[], list[tuple[int, Any]]] = lambda: []
        self.changes: tuple = ()  # the elastic shells, in the order they are asked (built in `attach`)
        self.stats = None  # this run's latest pool snapshot
        self.started = self.done = False
        self.final_ledger: list[int] = []  # once done: a recreated pool must know this run needs nothing more

    def attach(self, topo, pool: PoolClient, stream: StreamParts) -> None:
        """The stream started its pool: this run's slice of the drafter bundles (`RunTopology`), its run-scoped
        pool client, its group, and its elastic shells when its planners are given."""
        self.pool, self.alive_targets = pool, stream.alive_targets
        self.group = DrafterGroup(self.plan, topo, pool, self.monitor, stream.bundles, self.log, self.clock)
        if self.planners is not None:
            self.changes = self._elastic(self.planners, topo, stream)

    def _elastic(self, p: Planners, topo, stream: StreamParts) -> tuple:
        """The elastic shells, each handed the started parts it uses: a re-split (topology.rebalance=auto), a growth
        (bundles lost with a node placed again), an extra bundle (topology.max_extra_gpus: free cluster room)."""
        parts = dict(topo=topo, group=self.group, pool=self.pool, fleet=stream.fleet,
                     target_policy=stream.target_policy, drafter_policy=self.policy, monitor=self.monitor,
                     clock=self.clock, log=self.log)
        target_ids = itertools.count(self.cfg.topology.num_targets)  # new target slots: ids count on
        return (Resplitter(p.rebalancer, p.advisor, target_ids, **parts), Grower(p.growth, **parts),
                ExtraGpus(p.extra, p.advisor, p.rebalancer, target_ids, self.cfg.topology, **parts))

    def changing_group(self) -> bool:
        """Whether the drafter group is being stopped: a SIGTERM's stop, or a re-split, a growth or an extra
        drafter waiting for its checkpoint. One change at a time: each of them starts only when this is False."""
        return self.policy.stop_deadline is not None or any(change.stopping is not None for change in self.changes)

    # ---- each turn of the stream's loop ---------------------------------------------------

    def start_group(self) -> None:
        """The group's first start (in the loop, where a pool dying meanwhile is recreated); once."""
        if not self.started:
            self.started = True
            self._feed(self.group.start(self.plan.resume_from))

    def turn(self, wait_s: float) -> bool:
        """One look at this run's group (waiting up to `wait_s` for it); True once its drafters finished."""
        if self.done:
            return True
        if self.stop_event.is_set():
            self._feed(StopSignal())  # the policy acts on the first one only
        failed, results = self.group.finished(wait_s)
        self.stats = self.pool.stats()
        self.group.drain_records()
        self.monitor.add_pool(self.stats)
        if results is not None:
            self.group.drain_records()  # the last step's reports may land after the results
            for change in self.changes:  # the group stopped for a re-split, a growth or an extra rank, not the end
                if change.wants(results):
                    self._feed(change.carry_out())
                    return False
            self._finish(results)
            return True
        self._feed(failed)
        self._feed(self.watch.tick(self.stats, self.monitor.step, self.group.progress()))
        for change in self.changes:
            change.observe(busy=self.changing_group())  # one change at a time: asked again after each
        self._status()
        return False

    def _finish(self, results: list[Any]) -> None:
        self.outcome.drafter_results = results
        self.outcome.stopped = any(r.stopped for r in results)
        self.outcome.steps = max(r.steps for r in results)
        self.done = True
        self.final_ledger = self.pool.ledger()
        self._status(force=True)

    # ---- the stream recreates its pool ----------------------------------------------------

    def stop_for_recreate(self):
        """(checkpoint or None, ledger) the new pool restores for this run: its group's latest checkpoint (the
        group is stopped), or the final ledger of a run already done."""
        return (None, self.final_ledger) if self.done else self.group.stop_for_rebuild()

    def rebuild_on_new_pool(self, ckpt, action: RecreatePool) -> None:
        """The new pool holds this run's ledger: its group is rebuilt from that checkpoint (a first start the
        pool's death cut short starts here)."""
        if self.done:
            return
        self.started = True
        self.monitor.note(f"pool died -> recreated from {ckpt.name if ckpt else 'scratch'} "
                          f"({action.attempt}/{action.budget})")
        self._feed(self.group.rebuild(RebuildDrafters("pool recreated", action.attempt, action.budget, kind="pool")))

    # ---- policy ----------------------------------------------------------------------------

    def _feed(self, event) -> None:
        """Hand one event (None: nothing happened) to the drafter half and carry out what it decides."""
        if event is None:
            return
        for action in self.policy.on(event, self.clock()):
            if isinstance(action, Fail):
                raise RunFailed(action.message)
            if isinstance(action, RebuildDrafters):
                self._feed(self.group.rebuild(action))
            elif isinstance(action, RequestStop):
                self.pool.request_stop()
                self.log("received a stop signal (SIGTERM/SIGINT)")
                self.log(f"stop requested: checkpointing at the next step boundary (within {action.timeout_s:g} s)")
            else:
                raise AssertionError(f"unhandled drafter supervision action {action!r}")

    # ---- status and the end ----------------------------------------------------------------

    def _status(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_status >= self.cfg.logging.status_every_s:
            self.last_status = now
            self.log(self.monitor.line())
            if self.on_status is not None:
                self.on_status(self.monitor.values())

    def evaluate(self, export_dir: str | None) -> TauResult:
        """tau of a fresh drafter and of the exported one on the stream's live targets, with the code and spec of
        the evaluations during the run; never raises (see app/run/evaluate/final_tau.py)."""
        final = FinalTau(self.eval_spec, self.cfg.eval.timeout_s, self.clock, self.log)
        return final.measure(self.alive_targets(), export_dir, self.outcome.steps)
