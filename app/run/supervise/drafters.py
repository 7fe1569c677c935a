"""The data-parallel DrafterActor group: build, rebuild from the latest checkpoint, bundle waits, progress.

Each step returns the supervision event it produced (`DrafterGroupStarted`, `DrafterGroupFailed`) for the
run's supervisor to hand to its `DrafterPolicy`. A rebuild tears the whole group down, rolls the pool
back to the latest checkpoint's ledger (jobs trained after it are re-issued) and resumes a new group
from it, on fewer ranks when a lost node took GPUs nobody can replace.

Each group start has a generation, higher than any stamped in the checkpoint folder; rank 0 stamps it
into every checkpoint it writes. A rebuild resumes from the newest checkpoint of the group being
replaced or from before that group started (`rebuild_checkpoint`): a newer one stamped by an older
generation is a late write of a group killed earlier, whose weights the pool's ledger no longer matches.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from app.messages import DrafterPhase
from app.run.supervise.events import RunFailed, last_line
from app.run.supervise.events import DrafterGroupFailed, DrafterGroupStarted, RankProgress, RebuildDrafters
from app.run.supervise.targets import START_TIMEOUT_S
from app.storage.orphans import PROBE_PREFIX  # rank 0 writes <checkpoint.dir>/<PROBE_PREFIX><12 hex> per group start
from app.storage.roots import is_uri, open_storage, redact
from app.training.step_log import FILE_NAME as STEP_LOG_FILE, StepLog

PROGRESS_TIMEOUT_S = 30.0  # a drafter rank that does not answer a progress query this long is unresponsive
OLD_GROUP_EXIT_S = 60.0  # how long a rebuild waits for the killed ranks to be gone


def check_probe(root: str, name: str, token: str, where: str) -> None:
    """The driver reads back the probe rank 0 wrote (then removes it): a folder the driver does not see
    (a relative path resolved in another node's copy, a volume only one pod mounts) would make every
    rebuild and resume silently start from scratch. RunFailed, one line."""
    store = open_storage(root)
    seen = store.read_file(name)
    store.remove_file(name)
    if seen != token.encode():
        raise RunFailed(f"drafter rank 0 writes checkpoint.dir={redact(root)} as {redact(where)}, a folder this driver "
                        "does not see: its checkpoints would never be found and a rebuild would start from scratch; "
                        "put checkpoint.dir on storage every node mounts at the same path, or use an s3:// URI")


def rebuild_checkpoint(root: str, generation: int, resumed_step: int):
    """The newest checkpoint under `root` that a rebuild of group `generation` (which resumed at
    `resumed_step`) may resume from: stamped by that group or a later one, or no newer than its start.
    None when there is none (a rebuild from scratch)."""
    from app.training.checkpoint import list_checkpoints

    for ckpt in reversed(list_checkpoints(root)):
        if _step(ckpt) <= resumed_step or _generation(ckpt) >= generation:
            return ckpt
    return None


def next_generation(root: str, current: int) -> int:
    """A new group's generation: above the current one and above every one stamped under `root` (a
    resubmitted driver counts on from the previous run's groups)."""
    from app.training.checkpoint import list_checkpoints

    return max([current, *(_generation(c) for c in list_checkpoints(root))]) + 1


def _step(ckpt) -> int:
    from app.training.checkpoint import PREFIX

    return int(ckpt.name[len(PREFIX):])


def _generation(ckpt) -> int:
    from app.training.checkpoint import GENERATION_KEY, read_extra

    return int(read_extra(ckpt).get(GENERATION_KEY, 0))  # 0: written before generations were stamped


class BundleWaits:
    """Before a restart: a bundle on a lost node is re-placed by Ray once the GCS notices the death; an
    actor created into it earlier is cancelled, which would spend a restart for nothing."""

    def __init__(self, topo, log: Callable[[str], None]) -> None:
        self.topo, self.log = topo, log
        self.lost: set[int] = set()  # bundles a node loss left without a node at the last wait

    def wait(self, bundles: list[int], timeout_s: float) -> list[int]:
        """The bundles still without a live node after waiting (at most `timeout_s` for newly lost ones: a target
        restart's, or supervision.bundle_wait_s for the drafters)."""
        missing = self.topo.wait_bundles(bundles, 5.0)  # placed ones answer at once
        if missing and not set(missing) <= self.lost:  # newly lost: give Ray time to re-place them
            missing = self.topo.wait_bundles(missing, timeout_s)
        self.lost = (self.lost - set(bundles)) | set(missing)
        if missing:
            self.log(f"WARNING: bundles {missing} not placed on a live node within {timeout_s:g} s (the cluster "
                     "has no room for a lost node's share)")
        return missing


class DrafterGroup:
    """The ranks of the current group, their `run()` references and their latest progress answers."""

    def __init__(self, plan, topo, pool, monitor, bundles: BundleWaits, log: Callable[[str], None],
                 clock: Callable[[], float]) -> None:
        """`pool`: the run's PoolClient, which the ranks pull from and report their steps to; `monitor`: the
        run's RunMonitor, which those step records go to (`drain_records`)."""
        self.plan, self.cfg, self.topo, self.pool, self.monitor = plan, plan.cfg, topo, pool, monitor
        self.bundles, self.log, self.clock = bundles, log, clock
        self.ranks: list[Any] = []
        self.run_refs: list[Any] = []
        self.progress_query: dict[int, tuple[Any, float]] = {}  # rank -> (pending progress() ref, sent at)
        self.progress_seen: dict[int, RankProgress] = {}
        self.generation = 0  # of the group now running (0: none started yet)
        self.resumed_step = 0  # the step the group now running started at
        self.in_use: list[int] = []  # the bundles the running group's ranks sit in (fewer after a node loss)
        ckpt_dir = self.cfg.checkpoint.dir  # rank 0 writes the step log; on a URI there is no local file
        self.step_log = StepLog(Path(ckpt_dir) / STEP_LOG_FILE) if self.cfg.logging.step_log and not is_uri(ckpt_dir) \
            else None

    def start(self, resume_from: str | None, rebuilding: bool = False, bundles: list[int] | None = None):
        """Build the group and start its training loop: DrafterGroupStarted. A first start that fails is
        a setup error (RunFailed, one line); a rebuild that fails (a rank killed while joining) is one
        more DrafterGroupFailed."""
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        self.generation = next_generation(self.cfg.checkpoint.dir, self.generation)
        self.ranks = self.topo.make_drafters(self._setup(resume_from, bundles), self.pool.handle, bundles)
        self.in_use = list(bundles) if bundles else list(self.topo.drafter_bundles)
        self.progress_query, self.progress_seen = {}, {}
        try:  # setup builds the model and joins the process group: slow on a loaded box
            addr, port = ray.get(self.ranks[0].address.remote(), timeout=START_TIMEOUT_S)
            ready = ray.get([d.setup.remote(addr, port) for d in self.ranks], timeout=START_TIMEOUT_S)
        except (RayError, GetTimeoutError) as exc:
            if rebuilding:
                self.kill()
                self.run_refs, self.in_use = [], []
                return DrafterGroupFailed(f"group rebuild failed: {last_line(exc)}")
            raise RunFailed(f"DrafterActor group failed to start ({last_line(exc)})"
                            + (f" while resuming from {resume_from}" if resume_from else "")) from None
        self._probe()
        step, checksums = ready[0][0], sorted({round(c, 6) for _, c in ready})
        self.resumed_step = step
        self.monitor.restart_at(step)
        if self.step_log:
            self.step_log.group_start(step)
        self.log(f"drafter group of {len(self.ranks)} ready at step {step}"
                 + (f" (resumed from {resume_from})" if resume_from else "")
                 + f"; weights checksum {' '.join(f'{c:.6f}' for c in checksums)}")
        # The pool sizes each global step (ranks x grad_accum) for its pull policy: a group rebuilt on
        # fewer GPUs would otherwise be dealt steps for ranks that no longer exist.
        self.pool.set_ranks(len(self.ranks))
        self.run_refs = [d.run.remote() for d in self.ranks]
        return DrafterGroupStarted(step)

    def drain_records(self) -> None:
        """The step records the ranks reported to the pool, into the run's monitor: each loop turn, and
        before a new group starts (a stopped group's last reports belong before the new group's first)."""
        self.monitor.add_records(self.pool.drain_step_records())

    def stop_for_rebuild(self):
        """Kill the group and wait for its ranks to be gone; returns the checkpoint a new group resumes
        from (None: scratch) and its ledger."""
        import ray

        from app.training.checkpoint import read_ledger

        self.kill()
        # ray.kill is asynchronous: wait until the old ranks are gone, so no late ack or checkpoint
        # lands between reading the checkpoint and rolling the pool back to it.
        if self.run_refs:
            ray.wait(self.run_refs, num_returns=len(self.run_refs), timeout=OLD_GROUP_EXIT_S)
        ckpt = rebuild_checkpoint(self.cfg.checkpoint.dir, self.generation, self.resumed_step)
        return ckpt, (self.plan.jobs.scheduled_only(read_ledger(ckpt)[2]) if ckpt else list(self.plan.resume_ledger))

    def rebuild(self, action: RebuildDrafters):
        """Tear the group down, roll the pool back to the latest checkpoint and start a new group from it."""
        ckpt, ledger = self.stop_for_rebuild()
        self.drain_records()  # the dead group's last reports belong before the new group's start
        requeued = self.pool.rollback(ledger)
        self.pool.report_restart(action.kind)  # dflash_restarts_total{kind}: "pool" after a recreation
        self.monitor.note(f"{action.reason} -> group rebuilt from {ckpt.name if ckpt else 'scratch'}, "
                          f"{requeued} jobs re-issued ({action.attempt}/{action.budget})")
        self.log(f"{action.reason}; rebuilding the drafter group from {ckpt or 'scratch'}; {requeued} jobs "
                 f"re-issued ({action.attempt}/{action.budget})")
        bundles = list(self.topo.drafter_bundles)  # a re-split may have moved bundles between roles
        missing = self.bundles.wait(bundles, self.cfg.supervision.bundle_wait_s)
        placed = [b for b in bundles if b not in missing]
        if missing and placed:  # a lost node took GPUs nobody can replace: go on with fewer ranks
            self.log(f"rebuilding the drafter group with {len(placed)} of {len(bundles)} ranks: bundles {missing} "
                     "have no node (the LR schedule runs on jobs, so fewer ranks only slow the run)")
            self.monitor.note(f"drafter group shrunk to {len(placed)} ranks (bundles {missing} lost with a node)")
        return self.start(str(ckpt) if ckpt else None, rebuilding=True, bundles=placed or bundles)

    def finished(self, timeout_s: float):
        """(event, results): results when every rank's run() returned; a DrafterGroupFailed event when one
        raised or died; (None, None) while they train (waits up to `timeout_s`)."""
        import ray
        from ray.exceptions import RayError

        ready, _ = ray.wait(self.run_refs, num_returns=len(self.run_refs), timeout=timeout_s)
        if not ready:
            return None, None
        try:
            ray.get(ready)
        except RayError as exc:
            return DrafterGroupFailed(f"drafter crashed: {last_line(exc)}"), None
        return None, (ray.get(self.run_refs) if len(ready) == len(self.run_refs) else None)  # in rank order

    def progress(self) -> tuple[RankProgress, ...]:
        """Each rank's latest answer to a progress query, one query in flight per rank; a rank whose
        query is unanswered for PROGRESS_TIMEOUT_S is UNRESPONSIVE (frozen process, wedged node)."""
        import ray
        from ray.exceptions import RayError

        now = self.clock()
        for rank, drafter in enumerate(self.ranks):
            if rank not in self.progress_query:
                self.progress_query[rank] = (drafter.progress.remote(), now)
            ref, sent = self.progress_query[rank]
            if ray.wait([ref], timeout=0)[0]:
                del self.progress_query[rank]
                try:
                    p = ray.get(ref)
                except RayError:  # the rank died: its run() reference reports that to the loop
                    continue
                self.progress_seen[rank] = RankProgress(rank, p.phase, p.age_s, p.step)
            elif now - sent > PROGRESS_TIMEOUT_S:
                self.progress_seen[rank] = RankProgress(rank, DrafterPhase.UNRESPONSIVE, now - sent)
        return tuple(self.progress_seen[r] for r in sorted(self.progress_seen))

    def kill(self) -> None:
        import ray

        for d in self.ranks:
            ray.kill(d, no_restart=True)

    def _probe(self) -> None:
        """Rank 0 and the driver see one checkpoint.dir (`check_probe`)."""
        import ray
        import uuid

        token = uuid.uuid4().hex
        name = f"{PROBE_PREFIX}{token[:12]}"
        where = ray.get(self.ranks[0].write_probe.remote(name, token), timeout=START_TIMEOUT_S)
        check_probe(self.cfg.checkpoint.dir, name, token, where)

    def _setup(self, resume_from: str | None, bundles: list[int] | None):
        from app.storage import fence
        from app.training.drafter_io import DrafterSetup

        p, cfg = self.plan, self.cfg
        return DrafterSetup(
            world_size=len(bundles) if bundles else cfg.topology.num_drafters, model_dir=p.model_dir,
            layer_ids=p.layer_ids, mask_token_id=p.mask_token_id, drafter=cfg.drafter, train=cfg.train,
            checkpoint=cfg.checkpoint, faults=cfg.faults,
            device=cfg.topology.device if self.topo.plan.use_gpu else "cpu",
            num_cpus=cfg.topology.cpus_per_drafter, dtype=cfg.model.dtype,
            total_steps=p.total_steps, total_jobs=len(p.jobs), resume_from=resume_from,
            data_fingerprint=p.data_fingerprint, eval_every_steps=cfg.eval.every_steps,
            step_log=str(self.step_log.path) if self.step_log else None, group_generation=self.generation,
            max_payload_bytes=p.jobs.max_payload_bytes(),
            feature_layer_ids=getattr(p, "feature_layer_ids", None),  # a run of a sweep (app/run/sweep.py)
            fence_token=fence.extend(open_storage(cfg.checkpoint.dir)),  # the lease's token: a fenced-out run publishes nothing
        )
