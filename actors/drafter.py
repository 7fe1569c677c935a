"""DrafterActor: one replica of the data-parallel drafter group.

The rank's step protocol (accumulate `train.grad_accum` micro-batches with one pull prefetched, the
step's single all-reduce, acks after the optimizer step, the all-gather of job ids into the ledger rank 0
checkpoints, drains and end-of-stream, checkpoint and eval cadence) is `app/training/loop.py`; this
module drives it with the Ray calls, the trainer (`app/training/trainer.py`), the process group, the
step log, checkpoints and export, fault hooks, and the phases the supervisor's watchdog reads.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from app.training.checkpoint import TrainState, load_checkpoint, restore_rng, rng_state, save_checkpoint, state_checksum
from app.training.checkpoint import GENERATION_KEY
from app.training.effects import (AwaitPull, Checkpoint, Compute, Fetched, Gather, LoopConfig, NonFinite, OfferEval,
                                  PullAnswered, ReadStop, Reduce, SendAcks, Sleep, StartPull, StepDone, StepStart,
                                  Updated)
from app.training.loop import RankLoop, drive
from app.payload.nixl_receive import NixlReceiver
from app.training.rendezvous import Rendezvous
from app.training.step_log import StepLog
from app.config.schema import CheckpointConfig, DrafterConfig, FaultsConfig, TrainConfig
from app.devices import compute_dtype, limit_threads, pick_device
from app.faults import fire_once
from app.messages import Drained, DrafterPhase, DrafterProgress, EndOfStream, StepRecord, split_job_id


@dataclass(frozen=True)
class DrafterSetup:
    """What every replica of the group needs; identical across ranks but for `rank`."""

    world_size: int
    model_dir: str
    layer_ids: list[int]
    mask_token_id: int
    drafter: DrafterConfig
    train: TrainConfig
    checkpoint: CheckpointConfig
    faults: FaultsConfig
    device: str
    num_cpus: float
    dtype: str
    total_steps: int
    total_jobs: int  # the LR schedule runs on jobs consumed (app/training/trainer.py)
    resume_from: str | None  # checkpoint folder, or None for a fresh start
    data_fingerprint: str = ""  # saved with each checkpoint; resume refuses other data
    eval_every_steps: int = 0  # rank 0 offers its weights for an evaluation every N steps (eval.every_steps)
    step_log: str | None = None  # rank 0 appends each step's job ids here (logging.step_log, app/training/step_log.py)
    group_generation: int = 0  # stamped into each checkpoint: a rebuild ignores a killed group's late ones


@dataclass(frozen=True)
class DrafterResult:
    """A replica's view of the finished (or stopped) run."""

    rank: int
    steps: int
    stopped: bool
    weights_checksum: float
    last_checkpoint: str | None
    export_dir: str | None
    nonfinite: str = ""  # the run stopped at a non-finite step (why, one line); nothing of it was kept
    skipped_nonfinite: int = 0  # this rank's jobs of skipped non-finite steps (train.on_nonfinite=skip)


class _RankOps:
    """The step protocol's operations (app/training/loop.py) for one DrafterActor: Ray calls to the
    pool (one pull and its payload fetch in flight in a worker thread while the rank computes), the
    trainer, the process group, the step log, checkpoints, and the watchdog's phases."""

    def __init__(self, actor: "DrafterActor", generation: int) -> None:
        self.a, self.generation = actor, generation
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self.pending: Future | None = None
        self.t_step = time.perf_counter()
        self.last_ckpt: str | None = None
        self.skipped = 0  # jobs of skipped non-finite steps
        self.receiver = NixlReceiver()  # pool.transport=nixl payloads into reused buffers; others pass through

    def step_start(self, _: StepStart) -> None:
        self.t_step = time.perf_counter()

    def start_pull(self, eff: StartPull) -> None:
        self.pending = self.executor.submit(self._fetch, list(eff.acks))

    def pull_answered(self, _: PullAnswered) -> bool:
        return self.pending is None or self.pending.done()

    def await_pull(self, _: AwaitPull) -> Fetched:
        assert self.pending is not None, "the loop awaits a pull it never started"
        self.a._enter(DrafterPhase.WAIT_DATA)
        t0 = time.perf_counter()
        item, payload = self.pending.result()
        self.pending = None
        self.a._enter(DrafterPhase.COMPUTE)
        return Fetched(item, payload, time.perf_counter() - t0)

    def _fetch(self, acks: list[int]):
        return fetch_next(self.a.pool, self.a.rank, self.generation, acks, self.a.stager.stage,
                          receive=self.receiver.receive)

    def compute(self, eff: Compute) -> None:
        from app.model.loss import TrainBatch

        a, job_id = self.a, eff.item.meta.job_id
        a.epoch = max(a.epoch, split_job_id(job_id)[0])
        if isinstance(eff.payload, TrainBatch):  # staged on the GPU by the prefetch thread
            batch = a.stager.ready(eff.payload)
        else:
            batch = TrainBatch.from_hidden_batch(eff.payload, a.device, a.dtype)
        a.trainer.micro_step(batch, job_id)

    def send_acks(self, eff: SendAcks) -> None:
        import ray

        ray.get(self.a.pool.ack.remote(self.a.rank, list(eff.job_ids), self.generation))

    def read_stop(self, _: ReadStop) -> bool:
        import ray

        return bool(ray.get(self.a.pool.stop_requested.remote()))

    def reduce(self, eff: Reduce):
        self.a._maybe_stall(eff.eos)
        self.a._enter(DrafterPhase.COLLECTIVE)
        stats = self.a.trainer.finish_step(stop_requested=eff.stop, eos=eff.eos)
        self.a.step_now = self.a.trainer.step
        return stats

    def sleep(self, eff: Sleep) -> None:
        time.sleep(eff.seconds)

    def updated(self, eff: Updated) -> None:
        self.a._maybe_crash(eff.step)

    def nonfinite(self, eff: NonFinite) -> None:
        if eff.halt:  # the driver says it, in one line, from the result
            return
        self.skipped += len(eff.job_ids)
        if self.a.rank == 0:
            print(f"WARNING: step {eff.step} not applied ({eff.reason}); train.on_nonfinite=skip: its jobs are "
                  "counted as skipped_nonfinite, not learned", flush=True)

    def gather(self, eff: Gather) -> list[list[int]]:
        import torch.distributed as dist

        gathered: list[list[int]] = [[] for _ in range(self.a.cfg.world_size)]
        dist.all_gather_object(gathered, list(eff.job_ids))
        return gathered

    def step_done(self, eff: StepDone) -> None:
        a, stats = self.a, eff.totals
        a.ledger.update(j for ids in eff.gathered for j in ids)
        if a.step_log:  # before any checkpoint of this step
            a.step_log.step(eff.step, eff.gathered)
        step_s = time.perf_counter() - self.t_step
        a.pool.report_step.remote(StepRecord(  # fire and forget: telemetry must not slow the step
            rank=a.rank, step=eff.step, epoch=a.epoch, loss=stats.loss, weight_sum=stats.weight_sum,
            correct=stats.accuracy, tokens=stats.local_tokens, accept_len=stats.accept_len,
            per_pos_acc=stats.per_pos_acc, topk_acc=stats.topk_acc, compute_s=max(0.0, step_s - eff.wait_s),
            data_wait_s=eff.wait_s, lr=stats.lr, grad_norm=stats.grad_norm, job_ids=eff.job_ids))

    def checkpoint(self, _: Checkpoint) -> None:
        self.a._enter(DrafterPhase.COMPUTE)
        self.last_ckpt = self.a.save()

    def offer_eval(self, eff: OfferEval) -> None:
        """Rank 0: put the current weights in the object store for an evaluation on a target; the pool
        keeps the newest offer. Fire and forget: training goes on at once (app/run/evaluate/runner.py)."""
        import ray

        from app.model.live_eval import weights_to_numpy
        from app.training.retry import transient_object_errors, with_retries

        weights = weights_to_numpy(self.a.trainer.drafter)
        self.a.pool.offer_eval.remote(eff.step, [with_retries(lambda: ray.put(weights), transient_object_errors())])


def fetch_next(pool, rank: int, generation: int, acks: list[int], stage, on_pulled=None, receive=None):
    """The prefetch thread's work: pull one item (acks riding along) and fetch and `stage` its payload.
    Returns (pulled, staged payload), or (EndOfStream | Drained, None). `python -m app.bench transport`
    times this same function (`on_pulled()` marks the pull's answer). `receive` (a `NixlReceiver`'s) reads
    a `pool.transport=nixl` payload out of its target (a blocking get: NIXL refs cannot be awaited); a
    target that died before the read raises OwnerDiedError, an ObjectLostError: re-queued as below."""
    import ray
    from ray.exceptions import ObjectLostError

    from app.training.retry import transient_object_errors, with_retries

    transient = transient_object_errors()  # a full store, a timed-out fetch: tried again before giving up the job
    while True:
        pulled = ray.get(pool.pull.remote(rank, generation, acks))
        acks = []
        if isinstance(pulled, (EndOfStream, Drained)):
            return pulled, None
        if on_pulled is not None:
            on_pulled()
        try:  # CUDA: the stager copies it to the GPU (pinned, side stream), in this thread
            get = (lambda: receive(ray.get(pulled.payload_ref))) if receive else (lambda: ray.get(pulled.payload_ref))
            return pulled, stage(with_retries(get, transient))
        except ObjectLostError:  # the node holding it died: recompute that job, pull another
            ray.get(pool.payload_lost.remote(rank, pulled.meta.job_id, generation))


class DrafterActor:
    """One rank of the drafter group (gloo on CPU, nccl on GPU)."""

    def __init__(self, rank: int, setup: DrafterSetup, pool) -> None:
        limit_threads(setup.num_cpus)
        self.rank, self.cfg, self.pool = rank, setup, pool
        self.rendezvous = Rendezvous()
        self.step_log = StepLog(setup.step_log) if rank == 0 and setup.step_log else None  # rank 0 writes it
        self.device = pick_device(setup.device)
        self.dtype = compute_dtype(setup.dtype, self.device)
        self.step_now = 0
        self._phase = (DrafterPhase.SETUP, time.monotonic())

    def _enter(self, phase: str) -> None:
        """Record where the loop is, for the supervisor's watchdog (one tuple: read atomically)."""
        self._phase = (phase, time.monotonic())

    def progress(self) -> DrafterProgress:
        """Answered from a second actor thread while `run` trains (the actor has max_concurrency=2)."""
        phase, since = self._phase
        return DrafterProgress(self.rank, phase, time.monotonic() - since, self.step_now)

    def address(self) -> tuple[str, int]:
        """Rank 0's rendezvous address for torch.distributed: this node's address only (app/training/rendezvous.py)."""
        import ray

        return self.rendezvous.listen(ray.util.get_node_ip_address())

    def write_probe(self, name: str, token: str) -> str:
        """Rank 0 at group start: `token` into `<checkpoint.dir>/<name>`, for the driver to read back (both
        must see one folder, app/run/supervise/drafters.py `check_probe`). Returns where, on which node."""
        import ray

        from app.storage import is_uri, open_storage

        where = open_storage(self.cfg.checkpoint.dir).write_file(name, token.encode())
        return f"{where if is_uri(where) else os.path.abspath(where)} on node {ray.util.get_node_ip_address()}"

    def setup(self, master_addr: str, master_port: int) -> tuple[int, float]:
        """Join the process group, build the drafter, restore the checkpoint; returns the start step and
        the checksum of the weights this rank starts from (the supervisor logs it)."""
        import torch.distributed as dist

        from app.model.build import build_or_load_drafter
        from app.payload.staging import PayloadStager, staging_threads
        from app.training.trainer import DrafterTrainer

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, store=self.rendezvous.store(master_addr, master_port, self.cfg.world_size, self.rank == 0),
                                rank=self.rank, world_size=self.cfg.world_size)
        drafter, head, self.arch = build_or_load_drafter(
            self.cfg.model_dir, None, self.cfg.drafter, self.cfg.layer_ids, self.cfg.mask_token_id,
            self.device, self.dtype, self.cfg.train.seed, param_dtype=torch.float32)
        self.trainer = DrafterTrainer(drafter, head, self.cfg.drafter, self.cfg.train, self.cfg.total_steps,
                                      self.device, reducer=lambda flat: dist.all_reduce(flat),
                                      autocast=self.dtype if self.dtype != torch.float32 else None,
                                      total_jobs=self.cfg.total_jobs, delay_s=self.cfg.faults.drafter_delay_s)
        self.stager = PayloadStager(self.device, self.dtype, copy_threads=staging_threads(self.cfg.num_cpus))
        self.ledger: set[int] = set()
        self.epoch = 0
        if self.cfg.resume_from:
            self._restore(self.cfg.resume_from)
        for p in drafter.parameters():  # start identical on every rank, whatever the init did
            dist.broadcast(p.data, src=0)
        return self.trainer.step, state_checksum(drafter.state_dict())

    def _restore(self, path: str) -> None:
        state = load_checkpoint(path, map_location=str(self.device))
        self.trainer.drafter.load_state_dict(state.drafter)
        self.trainer.optimizer.load_state_dict(state.optimizer)
        self.trainer.scheduler.load_state_dict(state.scheduler)
        self.trainer.step, self.epoch, self.ledger = state.step, state.epoch, set(state.ledger)
        if state.rng:
            restore_rng(state.rng)

    def run(self) -> DrafterResult:
        """Train until every rank is dry or a stop is requested (the protocol: app/training/loop.py)."""
        import ray

        if self.device.type == "cuda":  # run may execute on another actor thread than setup did
            torch.cuda.set_device(self.device)
        # This incarnation's generation: pulls a dead predecessor sent are refused, not served.
        ops = _RankOps(self, ray.get(self.pool.generation.remote(self.rank)))
        c = self.cfg
        loop = RankLoop(LoopConfig(self.rank, c.world_size, c.train.grad_accum, c.checkpoint.every_steps,
                                   c.eval_every_steps, start_step=self.trainer.step))
        outcome = drive(loop, ops)
        ops.executor.shutdown(wait=False)
        self._enter(DrafterPhase.COMPUTE)
        result = DrafterResult(self.rank, self.trainer.step, outcome.stopped, self.weights_checksum(), ops.last_ckpt,
                               self.export() if (self.rank == 0 and not outcome.stopped) else None,
                               outcome.nonfinite, ops.skipped)
        self._enter(DrafterPhase.DONE)
        return result

    def _maybe_stall(self, eos: bool) -> None:
        # The last rank hangs outside any collective (the others wait in the all-reduce): at the
        # configured step, or when its stream ended first (then nothing is buffered any more).
        at = self.cfg.faults.stall_drafter_at_step
        if at >= 0 and self.rank == self.cfg.world_size - 1 and (self.trainer.step + 1 >= at or eos) \
                and fire_once(self.cfg.checkpoint.dir, "stall_drafter"):
            self._enter(DrafterPhase.COMPUTE)
            time.sleep(10**6)  # only the watchdog gets us out

    def _maybe_crash(self, step: int) -> None:
        # After the step's update but before its ack: the jobs are trained and not yet in the ledger.
        if self.rank == 0 and step == self.cfg.faults.kill_drafter_at_step and fire_once(
                self.cfg.checkpoint.dir, "kill_drafter"):
            os._exit(1)

    def save(self) -> str:
        """Rank 0: write the checkpoint (weights, optimizer, scheduler, RNG, step, epoch, ledger)."""
        t = self.trainer
        state = TrainState(step=t.step, epoch=self.epoch, ledger=sorted(self.ledger),
                           drafter=t.drafter.state_dict(), optimizer=t.optimizer.state_dict(),
                           scheduler=t.scheduler.state_dict(), rng=rng_state(),
                           extra={"data_fingerprint": self.cfg.data_fingerprint,
                                  GENERATION_KEY: self.cfg.group_generation})
        return str(save_checkpoint(self.cfg.checkpoint.dir, state, self.cfg.checkpoint.keep))

    def export(self) -> str:
        """Rank 0: the drafter as an HF folder at `<checkpoint.dir>/drafter` (uploaded when a URI)."""
        from app.model.export import export_drafter, export_dtype, publish_export
        from app.storage import is_uri, open_storage

        root, dtype = self.cfg.checkpoint.dir, export_dtype(self.cfg.checkpoint.export_dtype)  # bf16 by default
        if not is_uri(root):  # a temp sibling exchanged in: a reader never sees new weights beside an old config
            def write(tmp: Path) -> None:
                export_drafter(self.trainer.drafter, self.arch, tmp, dtype=dtype)

            return str(publish_export(os.path.join(root, "drafter"), write))
        store = open_storage(root)
        with store.scratch("drafter") as tmp:  # in this user's cache root, where a SIGKILL's leftover is cleaned
            export_drafter(self.trainer.drafter, self.arch, tmp, dtype=dtype)
            return store.upload_dir(tmp, "drafter", last="config.json")

    def weights_checksum(self) -> float:
        with torch.no_grad():
            return float(sum(p.double().sum() + (p.double() ** 2).sum() for p in self.trainer.drafter.parameters()))
