"""How every run ends: a single run is a sweep of one, so each run of a stream ends through the same steps.

The driver (app/run/driver.py) opens one `RunEnd` per run of its stream's supervisor (`sup.runs`: one run
named "" for a single run, the sweep's runs by name otherwise): the run's outputs (timeline, advice, evaluations,
report.html; app/run/outputs/run_outputs.py) and its wandb rows. Once the supervisor returns:
`check_finite` (train.on_nonfinite=stop: nothing of that step was checkpointed or exported), then either
`stop_runs` (SIGTERM: resubmit to resume) or `finish_run` for each run: tau of the export on the live
targets, summary.json, `drafter-speculators/` and the serving lines. A sweep adds its own summary.json
and report.html beside the runs' (`finish_sweep`). The stream's counts (the targets' forwards, the replay
store) are read once and go into every run's summary.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from app.run.supervise.events import RunFailed
from app.storage.roots import redact


@dataclass
class RunEnd:
    """One run's outputs beside its supervisor."""

    name: str  # "" for a single run; the run's name in a sweep
    sup: Any  # its RunSupervisor (app/run/run_supervisor.py)
    outputs: Any  # RunOutputs
    wandb: Any  # WandbLogger

    @classmethod
    def open(cls, sup, stream_name: str, name: str) -> RunEnd:
        """The run's timeline, advice, evaluations and report (`<run's checkpoint.dir>`), and its wandb run:
        a run of a sweep is `<stream>/<name>` in the timeline and `<stream>-<name>` in wandb."""
        from app.run.outputs.run_outputs import RunOutputs
        from app.run.outputs.wandb_log import WandbLogger

        label = f"{stream_name}/{name}" if name else stream_name
        outputs = RunOutputs(sup.cfg, label, sup.monitor, sup.plan.resume_step, log=sup.log)
        try:
            wandb = WandbLogger(sup.cfg.logging, label.replace("/", "-"), sup.cfg, sup.monitor, sup.plan.resume_step,
                                several=bool(name))
        except BaseException:
            outputs.close()
            raise
        sup.on_status = wandb.log  # the status-line values ride on the next step row
        return cls(name, sup, outputs, wandb)

    def export_dir(self) -> str | None:
        return next((r.export_dir for r in self.sup.outcome.drafter_results if r.export_dir), None)

    def close(self) -> None:
        self.wandb.finish({}, exit_code=1)  # a failed run's rows so far (a finished or stopped run: already done)
        self.outputs.close()  # report.html, for a stopped or failed run too


def check_finite(ends: dict[str, RunEnd]) -> None:
    """train.on_nonfinite=stop in any run: that step was neither checkpointed nor exported; the run fails."""
    for end in ends.values():
        outcome = end.sup.outcome
        nonfinite = next((r.nonfinite for r in outcome.drafter_results if r.nonfinite), "")
        if nonfinite:
            where = f"run {end.name}: " if end.name else ""
            raise RunFailed(f"{where}step {outcome.steps} is non-finite ({nonfinite}); stopped before checkpointing "
                            "or exporting it, the last checkpoint is the resume point; lower train.lr or "
                            "train.max_grad_norm, or set train.on_nonfinite=skip")


def stop_runs(ends: dict[str, RunEnd]) -> bool:
    """A stop (SIGTERM) ends every run at a checkpoint: each says so; True when the stream was stopped."""
    if not any(end.sup.outcome.stopped for end in ends.values()):
        return False
    for end in ends.values():
        steps = end.sup.outcome.steps
        end.sup.log(f"stopped cleanly at step {steps}; resubmit the same command to resume")
        end.wandb.finish({"stopped_at_step": steps})
    return True


def stream_counts(cfg, pool, targets: list[tuple[int, Any]]) -> tuple[dict, dict]:
    """What the stream did, read before any tau is measured on its `targets` (the live ones): the fields every
    run's summary gets (the targets' own forward counters, the replay store's counts), and the `pool`'s
    forwards issued by how many runs each fed (a single run's all fed one)."""
    import ray

    from app.replay.target_side import replay_summary

    issued = pool.handle.stream_counts.remote()
    fields = {"target_forwards": target_forwards(targets),
              **replay_summary(cfg.pool.replay, cfg.checkpoint.dir)}
    return fields, ray.get(issued)


def finish_run(end: RunEnd, stream: dict, elapsed: float) -> dict:
    """One run's end: tau of its export on the live targets, its summary.json, its serving lines."""
    from app.model.gguf_target import serving_name
    from app.run.outputs.run_outputs import print_serving, serving_outputs

    sup, log, cfg = end.sup, end.sup.log, end.sup.cfg
    outcome, export_dir = sup.outcome, end.export_dir()
    tau = sup.evaluate(export_dir)  # never raises: a dead or hung target gives None and the reason
    if tau.reason:
        log(f"WARNING: tau not fully measured ({tau.reason})")
    summary = build_summary(sup.plan, sup, sup.monitor, outcome, tau, elapsed)
    summary.update(stream)
    summary.update(end.outputs.finish(outcome.steps, export_dir))  # tau_history, tau_best, split_advice
    log(sup.monitor.line())  # the last status line: the end's tau and its health beside the final step
    summary.update(serving_outputs(cfg, sup.plan.model_dir, export_dir,  # launch lines, drafter-speculators/
                                   tau.trained if tau.trained is not None else
                                   (summary.get("tau_best") or {}).get("tau"), log,
                                   verifier=serving_name(cfg.model.target, sup.plan.model_dir)))
    if end.name:
        summary["drafter_run"] = end.name
    write_summary(cfg, summary)
    end.wandb.finish(summary)
    log(f"exported drafter to {export_dir}; tau {tau.untrained} -> {tau.trained}")
    print_serving(summary, log)
    return summary


def finish_sweep(cfg, stream_name: str, summaries: dict[str, dict], stream: dict, issued: dict, jobs: int,
                 elapsed: float) -> dict:
    """A sweep's own summary.json and report.html: the runs side by side, the forwards per job; returns
    the RESULT line's fields."""
    from app.run.outputs.sweep_summary import flat_result, render_sweep, sweep_summary
    from app.storage.roots import open_storage

    top = sweep_summary(summaries, issued, stream["target_forwards"], jobs, elapsed)
    top.update({k: v for k, v in stream.items() if k != "target_forwards"})
    write_summary(cfg, top)
    open_storage(cfg.checkpoint.dir).write_file("report.html", render_sweep(top, stream_name).encode())
    return flat_result(top)


def build_summary(plan, sup, monitor, outcome, tau, elapsed: float) -> dict:
    from app.run.supervise.pool_watch import ledger_report

    ledger = ledger_report(sup.pool.stats())
    checksums = {round(r.weights_checksum, 6) for r in outcome.drafter_results}
    return {
        "epochs": plan.cfg.train.epochs,
        "jobs_scheduled": len(plan.jobs),
        "jobs_acked": ledger["jobs_acked"],
        "jobs_acked_twice": ledger["jobs_acked_twice"],
        "jobs_quarantined": ledger["jobs_quarantined"],  # poison jobs: forward failed twice, never trained
        "quarantined_jobs": ledger["quarantined_jobs"],
        "jobs_trained_this_run": ledger["jobs_acked"] - len(set(plan.resume_ledger)),
        "jobs_skipped_nonfinite": sum(r.skipped_nonfinite for r in outcome.drafter_results),  # acked, not learned
        "steps": outcome.steps,
        "loss_first": monitor.loss_first,
        "loss_last": monitor.loss_last,
        "train_tok_s": monitor.train_tok_s(),
        "replica_tok_s": monitor.replica_tok_s(),
        "data_wait": monitor.data_wait_share(),
        "restarts": sum(outcome.restarts.values()),
        "faults": len(monitor.events),
        "tau_untrained": tau.untrained,
        "tau_trained": tau.trained,
        "tau_error": tau.reason,
        "health_trained": tau.health,  # the exported drafter's learning checks beside tau_trained (app/model/health.py)
        # Measured, not estimated: the exported drafter against the target alone, batch 1 (eval.race_prompts).
        "speedup_measured": (tau.race or {}).get("speedup"),
        "speed_race": tau.race,
        "replicas_identical": len(checksums) == 1,
        "resumed_from_step": plan.resume_step,
        "elapsed_s": elapsed,
        "fault_log": list(monitor.events),
        "data": plan.data_summary,
    }


def write_summary(cfg, summary: dict) -> str:
    """`<checkpoint.dir>/summary.json`, replaced in one step (a local path or a URI)."""
    from app.storage.roots import open_storage

    data = json.dumps(summary, indent=2, default=str).encode()
    return open_storage(cfg.checkpoint.dir).write_file("summary.json", data)


def target_forwards(targets: list[tuple[int, Any]]) -> int | None:
    """Forwards the live targets ran, by their own counters (None when one does not answer)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    try:
        return sum(ray.get([h.forward_count.remote() for _, h in targets], timeout=60))
    except (RayError, GetTimeoutError):
        return None


def result_line(fields: dict) -> str:
    """The `RESULT key=value ...` line a run ends with (lists and dicts are in summary.json only)."""
    return redact("RESULT " + " ".join(f"{k}={_fmt(v)}" for k, v in fields.items() if not isinstance(v, (list, dict))))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
