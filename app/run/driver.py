"""The driver's steps: plan (no Ray), connect, check resources, start, supervise, finish (see app/train.py)."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from app.config.schema import Config
from app.config.checks import check_resources
from app.config.errors import UserError
from app.pool.budget import check_object_store
from app.run.outputs.monitor import RunMonitor
from app.ray_cluster import init_ray
from app.storage.roots import redact


def log(msg: str) -> None:
    """The driver's status line; every plan, supervisor and output message goes through it, redacted."""
    print(f"[dflash {time.strftime('%H:%M:%S')}] {redact(msg)}", flush=True)


def run(cfg: Config) -> int:
    """Run (or resume) training; returns the process exit code."""
    from app.run.supervise.events import RunFailed

    from app.config.sweep_section import sweep_root

    cfg = sweep_root(cfg)  # several runs: topology.num_drafters is every run's ranks together
    lease = None
    try:
        check_dir_shared(cfg)
        lease = take_lease(cfg)  # before anything reads, cleans or prunes checkpoint.dir
        plan = make_plan(cfg)  # before ray.init: a mistake in the config or the data never waits for the cluster
        use_gpu = connect(cfg)
        plan.use_device(use_gpu)
        from app.run.plan import object_store_extras  # the dataset and eval offers share the store with the pool

        store = _object_store_bytes()
        extras = object_store_extras(plan) if store else (0, 0)  # Ray did not say: nothing to compare with
        check_object_store(cfg, plan.jobs.max_payload_bytes(), store, *extras)
    except UserError as exc:  # ConfigError, DataError, LeaseHeld
        print(f"{exc.kind} error: {redact(str(exc))}", file=sys.stderr)
        if lease is not None:
            lease.release()
        return 2
    except BaseException:  # a crash before the run starts: a caller in this process may start again on the dir
        if lease is not None:
            lease.release()
        raise
    stop, restore_signals = install_stop_handler()
    try:
        if cfg.runs:
            from app.run.sweep import supervise_sweep

            return supervise_sweep(plan, use_gpu, stop, log, build_summary, write_summary)
        return supervise(plan, use_gpu, stop)
    except RunFailed as exc:
        print(f"run failed: {redact(str(exc))}", file=sys.stderr)
        return 1
    except UserError as exc:  # found once the run starts: the placement group's timeout, wandb.init
        print(f"{exc.kind} error: {redact(str(exc))}", file=sys.stderr)
        return 2
    finally:
        restore_signals()
        lease.release()


def take_lease(cfg: Config):
    """This run's exclusive lease on checkpoint.dir (app/run/lease.py), kept alive until `release`."""
    from app.run.lease import RunLease

    lease = RunLease(cfg.checkpoint.dir, cfg.checkpoint.lease_timeout_s).acquire()
    if lease.taken_over:
        log(f"took over the stale run lease on {cfg.checkpoint.dir} (a run that ended without releasing it)")

    def lost(line: str) -> None:  # another run owns the folder now: any further write would mix the two
        print(f"run failed: {line}", file=sys.stderr, flush=True)
        os._exit(2)

    lease.keep_alive(lost)
    return lease


def check_dir_shared(cfg: Config) -> None:
    """A relative checkpoint.dir on an existing cluster (`ray job submit`) resolves in each node's own
    working-dir copy: the driver and rank 0 would write different folders. Refuse it."""
    from app.config.errors import ConfigError
    from app.storage.roots import is_uri

    address = os.environ.get("RAY_ADDRESS", "")
    if address and address != "local" and not is_uri(cfg.checkpoint.dir) and not os.path.isabs(cfg.checkpoint.dir):
        raise ConfigError(f"checkpoint.dir={cfg.checkpoint.dir!r} is relative, and this driver joins the cluster at "
                          "RAY_ADDRESS: every node would resolve it in its own copy of the working dir. Use an "
                          "absolute path on a volume every node mounts, or an s3:// URI")


def connect(cfg: Config) -> bool:
    """Join the cluster in RAY_ADDRESS (what `ray job submit` sets) or start a local one; check resources."""
    import ray

    from app.run.topology import uses_gpu

    if not ray.is_initialized():
        init_ray()
    resources = ray.cluster_resources()
    use_gpu = uses_gpu(cfg.topology, resources.get("GPU", 0.0))
    check_resources(cfg, resources, use_gpu)
    from app.run.placement import check_cluster_fits

    check_cluster_fits(cfg, use_gpu, ray.nodes())  # per node: names what is short where, before any actor
    return use_gpu


def spare_cpus(cfg: Config) -> float:
    """CPUs for tokenizing (data.num_workers=0, a large input, no cache): the cluster's, less the actors'."""
    import ray

    connect(cfg)
    from app.config.checks import reserved_resources

    return ray.cluster_resources().get("CPU", 0.0) - reserved_resources(cfg.topology, use_gpu=False)["CPU"]


def _object_store_bytes() -> float:
    """The cluster's object store, all nodes together (0 when Ray does not say)."""
    import ray

    return float(ray.cluster_resources().get("object_store_memory", 0.0))


def make_plan(cfg: Config):
    from app.run.plan import device_known, plan_run

    from app.training.checkpoint import clean_orphans

    for what in clean_orphans(cfg.checkpoint.dir):  # before the resume point is looked up
        log(f"checkpoint dir after a crash mid-save: {what}")
    t0 = time.monotonic()
    plan = plan_run(cfg, device_known(cfg), spare_cpus=lambda: spare_cpus(cfg), log=log)
    resumed = f", resuming from {plan.resume_from} (step {plan.resume_step}, {len(plan.resume_ledger)} jobs done)" \
        if plan.resume_from else ""
    log(f"target {plan.model_dir} layers {plan.layer_ids}; {len(plan.dataset)} sequences, {len(plan.jobs)} jobs over "
        f"{cfg.train.epochs} epochs, ~{plan.total_steps} steps{resumed} ({time.monotonic() - t0:.1f} s)")
    if plan.jobs_remaining == 0:
        log(f"every scheduled job is already in the ledger of {plan.resume_from}: nothing left to train; the run "
            "re-exports and measures tau. Raise train.epochs to train on, or use a new checkpoint.dir")
    return plan


def install_stop_handler():
    """SIGTERM (what `ray job stop` sends) and SIGINT ask for checkpoint-then-exit, once.

    Returns the stop event and a function that puts the previous handlers back."""
    stop = threading.Event()
    previous: dict[int, object] = {}

    def handler(signum, _frame):
        # Only flags here (printing from a handler can re-enter a print in progress); the
        # supervisor logs the stop. A second signal exits at once: Ray reaps the job's actors.
        if stop.is_set():
            os._exit(128 + signum)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, handler)

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return stop, restore


def supervise(plan, use_gpu: bool, stop: threading.Event) -> int:
    from app.run.supervise.events import RunFailed
    from app.model.gguf_target import serving_name
    from app.run.outputs.run_outputs import RunOutputs, print_serving, serving_outputs
    from app.run.plan import run_name
    from app.run.supervisor import Supervisor
    from app.run.topology import Topology, plan_bundles
    from app.run.outputs.wandb_log import WandbLogger

    cfg = plan.cfg
    name = run_name(cfg)
    topo = Topology(cfg, plan_bundles(cfg.topology, use_gpu), name)
    monitor = RunMonitor()
    outputs = RunOutputs(cfg, name, monitor, plan.resume_step, log=log)  # timeline, advice, evaluations, report
    wandb = WandbLogger(cfg.logging, name, cfg, monitor, plan.resume_step)  # a row per step, events
    sup = Supervisor(plan, topo, monitor, stop, log=log)
    sup.on_status = wandb.log
    t0 = time.monotonic()
    try:
        sup.start()
        outputs.attach(sup)
        log(f"{cfg.topology.num_targets} targets and {cfg.topology.num_drafters} drafters running (run '{name}')")
        outcome = sup.run()
        nonfinite = next((r.nonfinite for r in outcome.drafter_results if r.nonfinite), "")
        if nonfinite:  # train.on_nonfinite=stop: nothing of that step was checkpointed or exported
            raise RunFailed(f"step {outcome.steps} is non-finite ({nonfinite}); stopped before checkpointing or "
                            "exporting it, the last checkpoint is the resume point; lower train.lr or "
                            "train.max_grad_norm, or set train.on_nonfinite=skip")
        if outcome.stopped:
            log(f"stopped cleanly at step {outcome.steps}; resubmit the same command to resume")
            wandb.finish({"stopped_at_step": outcome.steps})
            return 0
        export_dir = next((r.export_dir for r in outcome.drafter_results if r.export_dir), None)
        tau = sup.evaluate(export_dir)  # never raises: a dead or hung target gives None and the reason
        if tau.reason:
            log(f"WARNING: tau not fully measured ({tau.reason})")
        summary = build_summary(plan, sup, monitor, outcome, tau, time.monotonic() - t0)
        from app.run.sweep import target_forwards

        summary["target_forwards"] = target_forwards(sup.alive_targets())  # the live targets' own counters
        from app.replay.target_side import replay_summary

        summary.update(replay_summary(cfg.pool.replay, cfg.checkpoint.dir))
        summary.update(outputs.finish(outcome.steps, export_dir))  # tau_history, tau_best, split_advice
        summary.update(serving_outputs(cfg, plan.model_dir, export_dir,  # launch lines, drafter-speculators/
                                       tau.trained if tau.trained is not None else
                                       (summary.get("tau_best") or {}).get("tau"), log,
                                       verifier=serving_name(cfg.model.target, plan.model_dir)))
        write_summary(cfg, summary)
        wandb.finish(summary)
        log(f"exported drafter to {export_dir}")
        print_serving(summary, log)
        print(redact("RESULT " + " ".join(f"{k}={_fmt(v)}" for k, v in summary.items() if not isinstance(v, (list, dict)))),
              flush=True)
        return 0
    finally:
        wandb.finish({}, exit_code=1)  # a failed run's rows so far (a finished or stopped run: already done)
        outputs.close()  # report.html, for a stopped or failed run too
        sup.shutdown()
        topo.remove()


def build_summary(plan, sup, monitor: RunMonitor, outcome, tau, elapsed: float) -> dict:
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
        # Measured, not estimated: the exported drafter against the target alone, batch 1 (eval.race_prompts).
        "speedup_measured": (tau.race or {}).get("speedup"),
        "speed_race": tau.race,
        "replicas_identical": len(checksums) == 1,
        "resumed_from_step": plan.resume_step,
        "elapsed_s": elapsed,
        "fault_log": list(monitor.events),
        "data": plan.data_summary,
    }


def write_summary(cfg: Config, summary: dict) -> str:
    """`<checkpoint.dir>/summary.json`, replaced in one step (a local path or a URI)."""
    from app.storage.roots import open_storage

    data = json.dumps(summary, indent=2, default=str).encode()
    return open_storage(cfg.checkpoint.dir).write_file("summary.json", data)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
