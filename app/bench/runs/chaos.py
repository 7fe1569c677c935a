"""Chaos rehearsal: train while a separate thread kills actors from outside, then count honestly.

    python -m app.bench chaos --config conf/tiny.yaml --faults 8 --seed 0 [key=value ...]

Starts a local Ray cluster, submits the driver (`python -m app.train`) as its own process, and
meanwhile injects `--faults` faults at random points of training (seeded): SIGKILL of a random target
or drafter process, SIGKILL of the pool actor (once; the driver recreates it in the same job within
`supervision.max_restarts_pool`), SIGTERM of the driver followed by a resubmission (once), and a sticky
target (once, from 4 faults on: a broken-but-alive GPU, `faults.sticky_target_error` on a random target
id, in effect from the start: it raises on every job until the pool calls it broken and the driver
restarts it). Each fault waits a random number of optimizer steps (`GAP_STEPS`) of the training group
after the previous one, read from the step log: counted in steps, not seconds, a run long enough for
the gaps gets every fault on any machine. It ends with one line:

    RESULT faults=... survived=... jobs_scheduled=... trained_once=... trained_twice=...
           never_trained=... quarantined=... tau_untrained=... tau_trained=...

Trained counts come from the step log (`logging.step_log`, `app/training/step_log.py`): the job ids each
rank put into each optimizer step, replayed along the lineage of the final weights. Not from the
pool's ledger, which the mechanism under test writes itself.

A config with several drafter runs on one stream (`runs:`, e.g. conf/tiny-sweep.yaml) is rehearsed the
same way: a drafter fault kills a rank of any run, and the counts come from each run's own step log
(`<checkpoint.dir>/runs/<name>/`), one set of fields per run (`<name>.trained_once`, ...).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.bench.common import own_cluster, print_result
from app.storage.roots import redact

FAULT_KINDS = ("target", "drafter")  # repeated; "pool", "driver" and "sticky" are added once each
GAP_STEPS = (2, 6)  # optimizer steps between faults (after the run trains again), drawn uniformly
MAX_SUBMISSIONS = 6


@dataclass
class ChaosState:
    """What the injector did and what the submissions saw; shared by the two threads."""

    fired: list[str] = field(default_factory=list)
    planned_exits: int = 0  # driver exits we caused (SIGTERM): each gets a resubmission
    driver: subprocess.Popen | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)


def plan_faults(n: int, rng: random.Random) -> list[str]:
    """`n` fault kinds in random order: the pool, the driver and a sticky target once each (when n allows),
    else targets/drafters."""
    once = ["pool", "driver", "sticky"][: max(0, min(2, n - 1) if n < 4 else 3)]
    kinds = once + [rng.choice(FAULT_KINDS) for _ in range(n - len(once))]
    rng.shuffle(kinds)
    return kinds


def main(argv: list[str] | None = None) -> int:
    from app.config.load import ConfigError, load_config

    ap = argparse.ArgumentParser(prog="python -m app.bench chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="conf/tiny.yaml")
    ap.add_argument("--faults", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides, as in app.train")
    args = ap.parse_args(argv)
    overrides = chaos_overrides(args) + list(args.overrides)
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.checkpoint.dir)
    if run_dir.exists() and any(run_dir.iterdir()):
        print(f"chaos error: checkpoint.dir={redact(run_dir)} is not empty; chaos counts a run from scratch: pass "
              "checkpoint.dir=<a new folder>", file=sys.stderr)
        return 2
    return run_chaos(args.config, overrides, run_dir, args.faults, args.seed, cfg.topology.num_targets,
                     [r.name for r in cfg.runs])


def chaos_overrides(args) -> list[str]:
    """Defaults for a rehearsal; the user's overrides come after and win."""
    budget = args.faults + 1  # every fault may hit the same target or the group
    return [f"checkpoint.dir={Path('runs').resolve()}/chaos-f{args.faults}-s{args.seed}-{int(time.time())}",
            "logging.step_log=true",  # absolute: the drivers join a cluster, which refuses a relative dir
            f"supervision.max_restarts_target={budget}", f"supervision.max_restarts_drafter_group={budget}",
            "checkpoint.every_steps=8", "logging.wandb_mode=disabled"]


def run_chaos(config: str, overrides: list[str], run_dir: Path, n_faults: int, seed: int, num_targets: int = 1,
              runs: list[str] | None = None) -> int:
    """`runs`: the names of a sweep's drafter runs (each counted from its own step log); None = one run."""
    from app.config.sweep_section import RUNS_FOLDER
    from app.training.step_log import FILE_NAME, count_trained

    # The drivers it starts join this cluster with its token (inherited environment).
    ray = own_cluster()
    state = ChaosState()
    rng = random.Random(seed)
    kinds = plan_faults(n_faults, rng)
    if "sticky" in kinds:  # in effect from the first start: the pool has to find the target broken itself
        kinds.remove("sticky")
        overrides = [*overrides, sticky_override(rng, num_targets, state)]
    folders = {name: run_dir / RUNS_FOLDER / name for name in runs} if runs else {"": run_dir}
    logs = [folder / FILE_NAME for folder in folders.values()]
    injector = threading.Thread(target=inject, args=(state, kinds, rng, logs, n_faults), daemon=True)
    survived, submissions = False, 0
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address, PYTHONUNBUFFERED="1")
    try:
        while submissions < MAX_SUBMISSIONS:
            submissions += 1
            log_path = run_dir / f"chaos-driver-{submissions}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with log_path.open("w") as out, state.lock:
                state.driver = subprocess.Popen([sys.executable, "-m", "app.train", "--config", config, *overrides],
                                                env=env, stdout=out, stderr=subprocess.STDOUT)
            _say(f"submission {submissions}: driver pid {state.driver.pid}, log {log_path}")
            if not injector.is_alive() and not state.done.is_set():
                injector.start()
            rc = state.driver.wait()
            finished = (run_dir / "summary.json").exists()
            _say(f"submission {submissions} exited {rc}" + (" with a summary" if finished else ""))
            if rc == 0 and finished:
                survived = True
                break
            with state.lock:
                expected = state.planned_exits > 0
                state.planned_exits = max(0, state.planned_exits - 1)
            if not expected:
                _say("unplanned driver exit; last lines:\n" + "".join(log_path.read_text().splitlines(True)[-15:]))
                break
    finally:
        state.done.set()
        ray.shutdown()
    top = json.loads((run_dir / "summary.json").read_text()) if survived else {}
    scheduled = int(top.get("jobs_scheduled", 0))
    result: dict = {"faults": len(state.fired), "survived": survived, "jobs_scheduled": scheduled}
    ok = survived
    for name, folder in folders.items():
        summary = json.loads((folder / "summary.json").read_text()) if survived else {}
        quarantined = int(summary.get("jobs_quarantined", 0) or 0)
        log = folder / FILE_NAME
        trained = count_trained(log) if log.exists() else None
        counts = trained.count(scheduled, quarantined) if trained \
            else {"trained_once": 0, "trained_twice": 0, "never_trained": scheduled}
        fields = {**counts, "quarantined": quarantined, "tau_untrained": summary.get("tau_untrained"),
                  "tau_trained": summary.get("tau_trained")}
        result.update({f"{name}.{k}" if name else k: v for k, v in fields.items()})
        ok = ok and counts["trained_twice"] == 0 and counts["never_trained"] == 0
    if runs:
        result["forwards_per_job"] = top.get("forwards_per_job")  # live targets' counters: restarted ones' not in it
    _say("fired: " + ", ".join(state.fired))
    print_result({k: _fmt(v) for k, v in result.items()})
    return 0 if ok else 1


def sticky_override(rng: random.Random, num_targets: int, state: ChaosState) -> str:
    """The override that makes a random target's first incarnation raise on every job; recorded as fired."""
    tid = rng.randrange(num_targets)
    state.fired.append(f"sticky target {tid} (its forward raises on every job from its start)")
    return f"faults.sticky_target_error={tid}"


def inject(state: ChaosState, kinds: list[str], rng: random.Random, step_logs: Path | list[Path],
           total: int | None = None) -> None:
    """The chaos thread: one fault after another, each once the run trains again after the last. `total`:
    every fault of the rehearsal, the sticky target (fired before this thread, in `state.fired`) included.
    `step_logs`: the run's step log, or each drafter run's of a sweep (paced by the one training most)."""
    total = len(state.fired) + len(kinds) if total is None else total
    step_logs = [step_logs] if isinstance(step_logs, Path) else list(step_logs)
    need_starts = 1  # group starts the step logs must show (all together) before the next fault
    after = [0] * len(step_logs)  # each log's lines already seen at the previous fault: the gap counts steps after them
    for kind in kinds:
        gap = rng.randint(*GAP_STEPS)
        while not state.done.is_set():
            if not _wait_training(state, step_logs, need_starts, gap, after):
                return
            with state.lock:
                driver = state.driver
                alive = driver is not None and driver.poll() is None and not state.done.is_set()
                what = fire(kind, driver, rng) if alive else None
                if what:
                    state.fired.append(what)
                    state.planned_exits += kind == "driver"  # a pool kill is survived in the same job
            if what:
                after = [len(_lines(log)) for log in step_logs]
                _say(f"fault {len(state.fired)}/{total}: {what}")  # of all faults: the sticky one counts in both
                if kind != "target":  # a new group (or driver) must be training before the next fault
                    need_starts = _group_starts(step_logs) + 1
                break
            time.sleep(1.0)  # no victim right now (the run is between drivers): try again


def fire(kind: str, driver: subprocess.Popen, rng: random.Random) -> str | None:
    """Carry out one fault from outside the run; returns what was done, or None when there was no victim."""
    if kind == "driver":
        driver.send_signal(signal.SIGTERM)
        return f"SIGTERM driver pid {driver.pid} (resubmitted after it checkpoints)"
    cls = {"target": "TargetActor", "drafter": "DrafterActor", "pool": "HSPoolActor"}[kind]
    pids = live_actor_pids(cls)
    if not pids:
        return None
    pid = rng.choice(sorted(pids))
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    return f"SIGKILL {cls} pid {pid}"


def live_actor_pids(class_name: str) -> list[int]:
    """PIDs of this cluster's live actors of one class (the GCS actor table; no dashboard needed)."""
    import ray._private.state as ray_state  # the public state API needs the dashboard

    actors = [a for a in ray_state.actors().values() if a.get("State") == "ALIVE" and a.get("Pid")]
    # Only the current driver's actors (the job of the live pool): a finished driver's actors may
    # still be listed ALIVE for a moment, and killing one of those would be a fault nobody sees.
    jobs = {a.get("JobID") for a in actors if a.get("ActorClassName") == "HSPoolActor"}
    return [int(a["Pid"]) for a in actors
            if a.get("ActorClassName") == class_name and (len(jobs) != 1 or a.get("JobID") in jobs)]


def _group_starts(step_logs: list[Path]) -> int:
    return sum('"group_start"' in l for log in step_logs for l in _lines(log))


def _lines(step_log: Path) -> list[str]:
    return step_log.read_text().splitlines() if step_log.exists() else []


def _wait_training(state: ChaosState, step_logs: list[Path], need_starts: int, steps: int = 1,
                   after: list[int] | None = None, timeout: float = 900.0) -> bool:
    """Until the logs show `need_starts` group starts in all and one of them `steps` steps after its last
    start and after its line `after`; False when the run ended."""
    deadline = time.monotonic() + timeout
    after = after or [0] * len(step_logs)
    while time.monotonic() < deadline and not state.done.is_set():
        if _group_starts(step_logs) >= need_starts and max(
                trained_since(_lines(log), 1, a) for log, a in zip(step_logs, after)) >= steps:
            return True
        time.sleep(0.5)
    return False


def trained_since(lines: list[str], need_starts: int, after: int) -> int:
    """Steps the step log shows after its last group start and after line `after`; 0 before it shows
    `need_starts` group starts."""
    starts = [i for i, l in enumerate(lines) if '"group_start"' in l]
    if len(starts) < need_starts:
        return 0
    return sum(l.startswith('{"rank": 0,') for l in lines[max(starts[-1] + 1, after):])  # one line per rank and step


def _say(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {redact(msg)}", flush=True)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    sys.exit(main())
