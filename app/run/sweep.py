"""Several drafter runs on one capture stream (`runs:`): their plans, their supervision, the driver's step.

The targets, the pool actor and the placement group are the stream's (`SweepSupervisor`, which starts
them and restarts targets as a single run does). Each run is a `RunSupervisor`: the single run's
supervisor over its own plan (its drafter/train sections, checkpoint folder `<checkpoint.dir>/runs/<name>`,
resume point), its drafter group in its own bundles, its run-scoped pool client, status line, outputs and
policy. A run's crash or stall rebuilds that run's group only and rolls back that run's ledger; the others
train on (their jobs are produced again for the rolled-back run alone). While one run is slow or
rebuilding, the others wait once the pool's shared budget is full (app/pool/stream.py).

Each run ends as a single run does (app/run/finish.py), in its own folder: export, tau (on the stream's live
targets), summary.json, serving lines, wandb rows and report.html; the sweep's summary.json compares them
(app/run/outputs/sweep_summary.py).

The targets compute the union of the runs' target layers once per job; each run's ranks take their own
layers out of that payload (`DrafterSetup.feature_layer_ids`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from app.run.elastic.planners import Planners
from app.run.plan import RunPlan
from app.run.supervise.events import RebuildDrafters, RecreatePool, StopSignal, TargetFailed, Tick
from app.run.supervise.policy import TargetState
from app.run.supervisor import Supervisor
from app.run.supervise.run_scoped import RunScoped, RunTopology

RUN_WAIT_S = 0.2  # each run's turn waits this long for its drafters


def plan_runs(plan: RunPlan) -> dict[str, RunPlan]:
    """The runs of this stream by name. A single run is a sweep of one: `{"": plan}`. With `runs:`, each
    run's plan from the sweep's (target, data, schedule shared): its config, layers, resume point and step
    count; the sweep's plan then captures the union of the runs' layers. Each run's layers were checked with
    the plan's target (app/config/layer_checks.py, before `ray.init`): inside the target, ascending, distinct."""
    from app.config.checks import resolved_layer_ids
    from app.config.sweep_section import run_config
    from app.run.plan import data_fingerprint, read_resume_point, total_steps

    if not plan.cfg.runs:
        return {"": plan}
    out: dict[str, RunPlan] = {}
    for spec in plan.cfg.runs:
        cfg = run_config(plan.cfg, spec)
        layers = resolved_layer_ids(cfg, plan.info)
        fingerprint = data_fingerprint(plan.dataset, cfg)
        resume = read_resume_point(cfg, plan.jobs, fingerprint)
        out[spec.name] = dataclasses.replace(
            plan, cfg=cfg, layer_ids=layers, resume_from=resume.path, resume_step=resume.step,
            resume_ledger=resume.ledger, data_fingerprint=fingerprint, total_steps=total_steps(cfg, plan.jobs))
    union = sorted({i for p in out.values() for i in p.layer_ids})
    plan.layer_ids = union
    for p in out.values():
        p.feature_layer_ids = union
    return out


class RunSupervisor(Supervisor):
    """One run of a sweep: the single run's supervision of its drafter group, without the targets."""

    def attach(self, stream: SweepSupervisor, first_bundle: int) -> None:
        from app.run.supervise.drafters import DrafterGroup
        from app.run.supervise.pool_client import PoolClient

        name = self.run_label
        n = self.cfg.topology.num_drafters
        self.topo = RunTopology(stream.topo, stream.topo.drafter_bundles[first_bundle:first_bundle + n])
        self.pool = PoolClient(RunScoped(stream.pool.handle, name), self.cfg.checkpoint.dir)
        self.stream, self.fleet = stream, stream.fleet  # targets: the stream's (evaluations use them)
        self.policy.targets.clear()  # this run's policy judges its drafters only
        self.group = DrafterGroup(self.plan, self.topo, self.pool, self.monitor, stream.bundles, self.log, self.clock)
        self.done = False
        self.started = False  # its group's first start ran (SweepSupervisor.run)

    def alive_targets(self) -> list[tuple[int, Any]]:
        return self.stream.alive_targets()

    def turn(self) -> bool:
        """One look at this run's group; True once its drafters finished."""
        if self.done:
            return True
        if self.stop_event.is_set():
            self._feed(StopSignal())
        failed, results = self.group.finished(RUN_WAIT_S)
        stats = self.pool.stats()
        self._drain_records()
        self.monitor.add_pool(stats)
        if results is not None:
            import ray

            self._drain_records()
            self._finish(results)
            self.done = True
            # A recreated pool must know this run needs nothing more, or its buffer would hold the budget.
            self.final_ledger = ray.get(self.pool.handle.ledger.remote())
            self._status(force=True)
            self.outcome.restarts = self.policy.restarts()
            return True
        self._feed(failed)
        tick = self.watch.tick(stats, self.monitor.step, self.group.progress())
        self._feed(dataclasses.replace(tick, oldest_in_flight_age_s={}))  # the stream's watchdog kills targets
        self._status()
        return False

    def _recreate_pool(self, action: RecreatePool) -> None:
        raise AssertionError("the stream recreates the pool of a sweep")


class SweepSupervisor(Supervisor):
    """The stream of a sweep: pool, targets, their restarts and watchdog; the runs' groups in turn."""

    def __init__(self, plan: RunPlan, runs: dict[str, RunPlan], topo, make_monitor, stop, log=print,
                 clock=time.monotonic) -> None:
        super().__init__(plan, topo, make_monitor(plan), stop, log=log, clock=clock)
        self.runs: dict[str, RunSupervisor] = {}
        for name, run_plan in runs.items():
            sup = RunSupervisor(run_plan, topo, make_monitor(run_plan), stop, log=_prefixed(log, name), clock=clock)
            sup.run_label = name
            self.runs[name] = sup

    def start(self) -> None:
        import ray

        from app.pool.stream import RunShape
        from app.run.supervise.drafters import DrafterGroup
        from app.run.supervise.pool_client import PoolClient
        from app.run.supervise.targets import Targets

        shapes = {n: RunShape(s.cfg.topology.num_drafters, s.cfg.train.grad_accum) for n, s in self.runs.items()}
        self.make_pool = lambda: self.topo.make_pool(len(self.cfg.data.bucket_boundaries), runs=shapes)
        self.pool = PoolClient(self.make_pool(), self.cfg.checkpoint.dir)
        first = 0
        for sup in self.runs.values():
            sup.fleet = None
            sup.attach(self, first)
            first += sup.cfg.topology.num_drafters
        self.schedule_refs = self._schedule_refs(ray)
        self._fill_all({n: s.plan.resume_ledger for n, s in self.runs.items()})
        self.fleet = Targets(self.plan, self.topo, self.pool, ray.put(self.plan.dataset), self.bundles.wait,
                             self.clock)
        for sup in self.runs.values():
            sup.fleet = self.fleet
        self.group = DrafterGroup(self.plan, self.topo, self.pool, self.monitor, self.bundles, self.log,
                                  self.clock)  # unused: the runs hold the groups
        self._feed_all(self.fleet.start_all())  # the groups start in `run`, where a pool dying meanwhile is recreated

    def _schedule_refs(self, ray) -> list:
        from app.data.costs import sequence_rows

        ds, dcfg = self.plan.dataset, self.cfg.drafter
        rows = sequence_rows(ds.loss_mask, ds.offsets, dcfg.block_size, dcfg.num_anchors)
        return [ray.put(epoch.with_costs(rows)) for epoch in self.plan.jobs.epochs]

    def _fill_all(self, ledgers: dict[str, list[int]]) -> None:
        for name, ledger in ledgers.items():
            self.runs[name].pool.restore_ledger(ledger)
        for ref in self.schedule_refs:
            self.pool.add_epoch(ref, self.plan.bytes_per_token)
        self.pool.finish_adding()

    def run(self):
        from app.run.supervise.pool_client import PoolDied

        while True:
            try:
                for sup in self.runs.values():  # the first start (or a start the pool's death cut short)
                    if not sup.started:
                        sup.started = True
                        sup._feed(sup.group.start(sup.plan.resume_from))
                finished = [sup.turn() for sup in list(self.runs.values())]
                if all(finished):
                    break
                self._targets_turn()
            except PoolDied as exc:
                from app.run.supervise.events import PoolFailed

                self._feed(PoolFailed(str(exc)))
        self.outcome.restarts = self.policy.restarts()
        return self.outcome

    def _targets_turn(self) -> None:
        """The single run's target half of a loop turn: restarts, failures, the target watchdog."""
        stats = self.runs[next(iter(self.runs))].pool.stats()  # any run's snapshot carries the target fields
        self._feed_all(self._log_restarted(self.fleet.poll_starts()))
        self._note_quarantined(stats)
        for failure in self.watch.new_failures(stats):
            self._feed(failure)
        self._feed_all(self.fleet.watch_idle(stats.oldest_in_flight_age_s))
        # Only the target watchdog here: no ranks and nothing servable, so the drafter rule never fires.
        self._feed(Tick(dict(stats.oldest_in_flight_age_s), False, 0, (), quarantined=len(stats.quarantined),
                        total_jobs=stats.total_jobs))

    def _recreate_pool(self, action: RecreatePool) -> None:
        """A new pool from each run's checkpoint; the live targets handed over; every run's group rebuilt."""
        self.log(f"{action.reason.split('; the run stops here')[0]}; recreating it from each run's latest checkpoint "
                 f"({action.attempt}/{action.budget}, supervision.max_restarts_pool)")
        ledgers = {}
        for name, sup in self.runs.items():
            _, ledgers[name] = sup.group.stop_for_rebuild() if not sup.done else (None, sup.final_ledger)
        self.pool.recreate(self.make_pool, self.clock)
        for sup in self.runs.values():
            sup.pool.replace(RunScoped(self.pool.handle, sup.run_label))
        self._fill_all(ledgers)
        self.watch.new_pool()
        self._hand_over_targets()
        for tid, slot in self.policy.targets.items():  # the dead pool would have reported these
            if slot.state is TargetState.KILLED:
                self._feed(TargetFailed(tid, "killed by the watchdog while the pool died"))
        if self.stop_event.is_set():
            for sup in self.runs.values():
                sup.pool.request_stop()
        for sup in self.runs.values():
            sup.started = True  # a group whose first start the pool's death cut short starts in this rebuild
            if not sup.done:
                sup.monitor.note(f"pool died -> recreated ({action.attempt}/{action.budget})")
                sup._feed(sup.group.rebuild(RebuildDrafters("pool recreated", action.attempt, action.budget,
                                                            kind="pool")))

    def evaluate(self, export_dir):
        raise AssertionError("each run of a sweep measures its own tau")

    def shutdown(self) -> None:
        import ray

        handles = [*(r for sup in self.runs.values() if sup.group for r in sup.group.ranks),
                   *(self.fleet.handles() if self.fleet else []), *([self.pool.handle] if self.pool else [])]
        for h in handles:
            ray.kill(h, no_restart=True)


def stream_supervisor(plan: RunPlan, runs: dict[str, RunPlan], topo, stop, log=print) -> Supervisor:
    """The supervisor of a stream's runs (`plan_runs`): a single run (`{"": plan}`) is its own stream, with
    the elastic changes (re-split, growth, extra GPUs) a sweep has not; several runs share the stream's
    targets and pool. Either way `sup.runs` is every run's supervisor by name, each with its own monitor."""
    if list(runs) == [""]:
        planners = Planners.for_run(plan.cfg)
        return Supervisor(runs[""], topo, run_monitor(runs[""], planners), stop, log=log, planners=planners)
    return SweepSupervisor(plan, runs, topo, lambda p: run_monitor(p, Planners.for_run(p.cfg)), stop, log=log)


def run_monitor(plan: RunPlan, planners: Planners):
    """A run's monitor, handed what it shows and summarises: its planners (a run of a sweep changes no group,
    and its summary says so as a single run's with no change does) and the steps rank 0 offers for evaluation."""
    from app.run.evaluate.runner import offered_every
    from app.run.outputs.monitor import RunMonitor

    return RunMonitor(advisor=planners.advisor, rebalancer=planners.rebalancer, grower=planners.growth,
                      extra=planners.extra, eval_every=offered_every(plan))


def _prefixed(log, name: str):
    return lambda msg: log(f"[{name}] {msg}")
