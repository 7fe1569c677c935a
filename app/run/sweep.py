"""The run list of a stream: a single run is a sweep of one (`{"": plan}`); `runs:` gives several drafter runs on
one capture stream. Their plans (`plan_runs`) and their supervisors (`stream_supervisor`).

The targets, the pool actor and the placement group are the stream's (`StreamSupervisor`,
app/run/supervisor.py). Each run is a `RunSupervisor` (app/run/run_supervisor.py) over its own plan (its
drafter/train sections, checkpoint folder `<checkpoint.dir>/runs/<name>`, resume point), its drafter group in
its own bundles, its run-scoped pool client, status line, outputs and the drafter half of the policy. A run's
crash or stall rebuilds that run's group only and rolls back that run's ledger; the others train on (their
jobs are produced again for the rolled-back run alone). While one run is slow or rebuilding, the others wait
once the pool's shared budget is full (app/pool/stream.py).

Each run ends as a single run does (app/run/finish.py), in its own folder: export, tau (on the stream's live
targets), summary.json, serving lines, wandb rows and report.html; the sweep's summary.json compares them
(app/run/outputs/sweep_summary.py).

The targets compute the union of the runs' target layers once per job; each run's ranks take their own
layers out of that payload (`DrafterSetup.feature_layer_ids`).
"""
from __future__ import annotations

import dataclasses

from app.run.elastic.planners import Planners
from app.run.plan import RunPlan
from app.run.run_supervisor import RunSupervisor
from app.run.supervisor import StreamSupervisor


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


def stream_supervisor(plan: RunPlan, runs: dict[str, RunPlan], topo, stop, log=print) -> StreamSupervisor:
    """The supervisor of a stream's runs (`plan_runs`), one road for one run and several: a `RunSupervisor` per
    run (its own monitor; a run of a sweep logs with its name in front) under one `StreamSupervisor` that owns
    the targets and the pool. The one choice made here, with the run list: a single run (`{"": plan}`) changes
    its group while it trains (re-split, growth, extra GPUs: its planners are handed to it); the runs of a sweep
    share the stream's bundles in fixed slices and change none."""
    elastic = list(runs) == [""]
    members = {}
    for name, run_plan in runs.items():
        planners = Planners.for_run(run_plan.cfg)
        members[name] = RunSupervisor(name, run_plan, run_monitor(run_plan, planners), stop,
                                      log=_prefixed(log, name),
                                      planners=planners if elastic else None)
    return StreamSupervisor(plan, members, topo, log=log)


def run_monitor(plan: RunPlan, planners: Planners):
    """A run's monitor, handed what it shows and summarises: its planners (a run of a sweep changes no group,
    and its summary says so as a single run's with no change does) and the steps rank 0 offers for evaluation."""
    from app.run.evaluate.runner import offered_every
    from app.run.outputs.monitor import RunMonitor

    return RunMonitor(advisor=planners.advisor, rebalancer=planners.rebalancer, grower=planners.growth,
                      extra=planners.extra, eval_every=offered_every(plan))


def _prefixed(log, name: str):
    """A run's log: its name in front of each line (a single run's, named "", as the stream's)."""
    return (lambda msg: log(f"[{name}] {msg}")) if name else log
