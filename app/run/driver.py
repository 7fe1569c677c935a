"""The driver's steps: plan (no Ray), connect, pre-flight (app/run/preflight.py), supervise every run, finish each
(app/run/finish.py); see app/train.py."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

from app.config.schema import Config
from app.config.errors import UserError
from app.run.preflight import Cluster, check_dir_shared, preflight, read_cluster
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
        cluster = connect(cfg)
        runs = preflight(plan, cluster)  # a single run is a sweep of one: {"": plan}
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
        return supervise(plan, runs, cluster.use_gpu, stop)
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
    from app.storage.local_cache import set_download_bound

    set_download_bound(int(cfg.checkpoint.download_cache_gb * 2**30))  # this node's download cache (local_cache.py)
    lease = RunLease(cfg.checkpoint.dir, cfg.checkpoint.lease_timeout_s).acquire()
    if lease.taken_over:
        log(f"took over the stale run lease on {cfg.checkpoint.dir} (a run that ended without releasing it)")

    def lost(line: str) -> None:  # another run owns the folder now: any further write would mix the two
        print(f"run failed: {line}", file=sys.stderr, flush=True)
        os._exit(2)

    lease.keep_alive(lost)
    return lease


def connect(cfg: Config) -> Cluster:
    """Join the cluster in RAY_ADDRESS (what `ray job submit` sets) or start a local one; what it has."""
    import ray

    if not ray.is_initialized():
        init_ray()
    return read_cluster(cfg)


def spare_cpus(cfg: Config) -> float:
    """CPUs for tokenizing (data.num_workers=0, a large input, no cache): the cluster's, less the actors'."""
    import ray

    connect(cfg)
    from app.config.checks import reserved_resources

    return ray.cluster_resources().get("CPU", 0.0) - reserved_resources(cfg.topology, use_gpu=False)["CPU"]


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


def supervise(plan, runs: dict, use_gpu: bool, stop: threading.Event) -> int:
    """One road for one run and for a sweep: `runs` by name (`plan_runs`; a single run is `{"": plan}`).
    Every run gets every output and ends through app/run/finish.py; a sweep adds its own summary."""
    from app.run.finish import RunEnd, check_finite, finish_run, finish_sweep, result_line, stop_runs, stream_counts
    from app.run.plan import run_name
    from app.run.sweep import stream_supervisor
    from app.run.topology import Topology, plan_bundles

    cfg = plan.cfg
    name = run_name(cfg)
    topo = Topology(cfg, plan_bundles(cfg.topology, use_gpu), name)
    sup = stream_supervisor(plan, runs, topo, stop, log)
    ends: dict[str, RunEnd] = {}
    t0 = time.monotonic()
    try:
        for run, run_sup in sup.runs.items():
            ends[run] = RunEnd.open(run_sup, name, run)
        sup.start()
        for end in ends.values():  # evaluations during the run, on the started targets
            end.outputs.attach(end.sup.plan, end.sup.eval_spec, end.sup.pool, end.sup.alive_targets)
        split = ", ".join(f"{r}: {s.cfg.topology.num_drafters}" for r, s in sup.runs.items() if r)  # a sweep's
        log(f"{cfg.topology.num_targets} targets and {cfg.topology.num_drafters} drafters running (run '{name}'"
            f"{f'; drafters per run {split}' if split else ''}), target layers {plan.layer_ids}")
        sup.run()
        check_finite(ends)
        if stop_runs(ends):
            return 0
        stream, issued = stream_counts(cfg, sup.pool, sup.alive_targets())
        summaries = {run: finish_run(end, stream, time.monotonic() - t0) for run, end in ends.items()}
        fields = summaries[""] if "" in summaries else finish_sweep(cfg, name, summaries, stream, issued,
                                                                    len(plan.jobs), time.monotonic() - t0)
        print(result_line(fields), flush=True)
        return 0
    finally:
        for end in ends.values():
            end.close()
        sup.shutdown()
        topo.remove()
