"""DrafterActor: one replica of the data-parallel drafter group.

Each replica pulls its own micro-batches from the pool (prefetching the next pull while it computes),
and every `train.grad_accum` micro-batches joins the step's single all-reduce (`app/training/trainer.py`).
After the optimizer step every rank acks its own jobs to the pool, and the ranks all-gather the step's
job ids into the ledger rank 0 checkpoints, so that ledger is exactly the set of jobs inside the saved
weights. A rank that runs dry joins with zeros until all are dry.
"""
from __future__ import annotations

import os
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from app.training.step_log import StepLog
from app.training.checkpoint import TrainState, load_checkpoint, restore_rng, rng_state, save_checkpoint, state_checksum
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


@dataclass(frozen=True)
class DrafterResult:
    """A replica's view of the finished (or stopped) run."""

    rank: int
    steps: int
    stopped: bool
    weights_checksum: float
    last_checkpoint: str | None
    export_dir: str | None


class _Prefetcher:
    """Keeps one pull (and its payload fetch) in flight while the replica computes. A step's acks
    ride on the next pull it sends (one call per item), or go at once if a pull is still waiting."""

    def __init__(self, pool, rank: int, generation: int, stage=None) -> None:
        self.pool, self.rank, self.generation = pool, rank, generation
        self.stage = stage or (lambda payload: payload)  # CUDA: pinned copy to the GPU, in this thread
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self.pending: Future | None = None
        self.acks: list[int] = []

    def ack(self, job_ids: list[int]) -> None:
        """After the optimizer step: these jobs go to the pool's ledger with the next pull."""
        if self.pending is not None and not self.pending.done():
            import ray  # the pull in flight waits for data: do not hold the acks behind it

            ray.get(self.pool.ack.remote(self.rank, self.acks + job_ids, self.generation))
            self.acks = []
        else:
            self.acks += job_ids

    def _submit(self) -> Future:
        acks, self.acks = self.acks, []
        return self.executor.submit(self._fetch, acks)

    def _fetch(self, acks: list[int]):
        import ray
        from ray.exceptions import ObjectLostError

        while True:
            pulled = ray.get(self.pool.pull.remote(self.rank, self.generation, acks))
            acks = []
            if isinstance(pulled, (EndOfStream, Drained)):
                return pulled, None
            try:
                return pulled, self.stage(ray.get(pulled.payload_ref))
            except ObjectLostError:  # the node holding it died: recompute that job, pull another
                ray.get(self.pool.payload_lost.remote(self.rank, pulled.meta.job_id, self.generation))

    def next(self):
        """(item, payload, seconds waited); item is EndOfStream when the stream is over."""
        if self.pending is None:
            self.pending = self._submit()
        t0 = time.perf_counter()
        item, payload = self.pending.result()
        waited = time.perf_counter() - t0
        # After end-of-stream or a drain, pull again only when asked (a drain clears after acks).
        self.pending = None if isinstance(item, (EndOfStream, Drained)) else self._submit()
        return item, payload, waited


class DrafterActor:
    """One rank of the drafter group (gloo on CPU, nccl on GPU)."""

    def __init__(self, rank: int, setup: DrafterSetup, pool) -> None:
        limit_threads(setup.num_cpus)
        self.rank, self.cfg, self.pool = rank, setup, pool
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
        """Rank 0's rendezvous address for torch.distributed."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind(("", 0))
            return ip, sock.getsockname()[1]

    def setup(self, master_addr: str, master_port: int) -> tuple[int, float]:
        """Join the process group, build the drafter, restore the checkpoint; returns the start step and
        the checksum of the weights this rank starts from (the supervisor logs it)."""
        import torch.distributed as dist

        from app.model.build import build_or_load_drafter
        from app.training.transfer import PayloadStager
        from app.training.trainer import DrafterTrainer

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                                rank=self.rank, world_size=self.cfg.world_size)
        drafter, head, self.arch = build_or_load_drafter(
            self.cfg.model_dir, None, self.cfg.drafter, self.cfg.layer_ids, self.cfg.mask_token_id,
            self.device, self.dtype, self.cfg.train.seed, param_dtype=torch.float32)
        self.trainer = DrafterTrainer(drafter, head, self.cfg.drafter, self.cfg.train, self.cfg.total_steps,
                                      self.device, reducer=lambda flat: dist.all_reduce(flat),
                                      autocast=self.dtype if self.dtype != torch.float32 else None,
                                      total_jobs=self.cfg.total_jobs)
        self.stager = PayloadStager(self.device, self.dtype)
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
        """Train until every rank is dry or a stop is requested."""
        import ray
        import torch.distributed as dist

        if self.device.type == "cuda":  # run may execute on another actor thread than setup did
            torch.cuda.set_device(self.device)
        # This incarnation's generation: pulls a dead predecessor sent are refused, not served.
        fetch = _Prefetcher(self.pool, self.rank, ray.get(self.pool.generation.remote(self.rank)),
                            stage=self.stager.stage)
        eos, stopped, last_ckpt = False, False, None
        while True:
            t_step = time.perf_counter()
            job_ids, wait_s, eos = self._accumulate(fetch, eos)
            self._maybe_stall(eos)
            stop = self.rank == 0 and bool(ray.get(self.pool.stop_requested.remote()))
            self._enter(DrafterPhase.COLLECTIVE)
            stats = self.trainer.finish_step(stop_requested=stop, eos=eos)
            self.step_now = self.trainer.step
            if stats.eos_ranks == self.cfg.world_size:
                break  # every rank's stream is over
            if stats.active_ranks == 0 and not stats.stop:
                time.sleep(0.05)  # all ranks drained while leases elsewhere await acks: pull again
                continue
            self._maybe_crash(stats.step)
            if job_ids:  # after the optimizer step: a crash before this re-issues the jobs
                fetch.ack(job_ids)
            gathered: list[list[int]] = [[] for _ in range(self.cfg.world_size)]
            dist.all_gather_object(gathered, job_ids)
            self.ledger.update(j for ids in gathered for j in ids)
            if self.step_log:  # before any checkpoint of this step
                self.step_log.step(self.trainer.step, gathered)
            self._report(stats, job_ids, wait_s, time.perf_counter() - t_step)
            if stats.stop:
                stopped = True
                break
            if self.rank == 0 and self.trainer.step % self.cfg.checkpoint.every_steps == 0:
                self._enter(DrafterPhase.COMPUTE)
                last_ckpt = self.save()
            if self.rank == 0 and self.cfg.eval_every_steps and self.trainer.step % self.cfg.eval_every_steps == 0:
                self._offer_eval()
        self._enter(DrafterPhase.COMPUTE)
        if self.rank == 0:
            last_ckpt = self.save()
        result = DrafterResult(self.rank, self.trainer.step, stopped, self.weights_checksum(), last_ckpt,
                               self.export() if (self.rank == 0 and not stopped) else None)
        self._enter(DrafterPhase.DONE)
        return result

    def _accumulate(self, fetch: "_Prefetcher", eos: bool) -> tuple[list[int], float, bool]:
        """Up to grad_accum micro-batches: (job ids trained, seconds waiting for data, stream ended)."""
        from app.model.loss import TrainBatch

        job_ids: list[int] = []
        wait_s = 0.0
        for _ in range(self.cfg.train.grad_accum):
            if eos:
                break
            self._enter(DrafterPhase.WAIT_DATA)
            item, payload, waited = fetch.next()
            self._enter(DrafterPhase.COMPUTE)
            wait_s += waited
            if isinstance(item, EndOfStream):
                eos = True
                break
            if isinstance(item, Drained):
                break  # nothing buffered, others hold the last leases: step with what we have
            self.epoch = max(self.epoch, split_job_id(item.meta.job_id)[0])
            if isinstance(payload, TrainBatch):  # staged on the GPU by the prefetch thread
                batch = self.stager.ready(payload)
            else:
                batch = TrainBatch.from_hidden_batch(payload, self.device, self.dtype)
            self.trainer.micro_step(batch, item.meta.job_id)
            job_ids.append(item.meta.job_id)
        return job_ids, wait_s, eos

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

    def _report(self, stats, job_ids: list[int], wait_s: float, step_s: float) -> None:
        rec = StepRecord(
            rank=self.rank, step=self.trainer.step, epoch=self.epoch, loss=stats.loss, weight_sum=stats.weight_sum,
            correct=stats.accuracy, tokens=stats.local_tokens, accept_len=stats.accept_len,
            per_pos_acc=stats.per_pos_acc, topk_acc=stats.topk_acc, compute_s=max(0.0, step_s - wait_s), data_wait_s=wait_s,
            lr=stats.lr, grad_norm=stats.grad_norm, job_ids=tuple(job_ids),
        )
        self.pool.report_step.remote(rec)  # fire and forget: telemetry must not slow the step

    def _offer_eval(self) -> None:
        """Rank 0: put the current weights in the object store for an evaluation on a target; the pool
        keeps the newest offer. Fire and forget: training goes on at once (app/run/eval_runner.py)."""
        import ray

        from app.model.live_eval import weights_to_numpy

        self.pool.offer_eval.remote(self.trainer.step, [ray.put(weights_to_numpy(self.trainer.drafter))])

    def save(self) -> str:
        """Rank 0: write the checkpoint (weights, optimizer, scheduler, RNG, step, epoch, ledger)."""
        t = self.trainer
        state = TrainState(step=t.step, epoch=self.epoch, ledger=sorted(self.ledger),
                           drafter=t.drafter.state_dict(), optimizer=t.optimizer.state_dict(),
                           scheduler=t.scheduler.state_dict(), rng=rng_state(),
                           extra={"data_fingerprint": self.cfg.data_fingerprint})
        return str(save_checkpoint(self.cfg.checkpoint.dir, state, self.cfg.checkpoint.keep))

    def export(self) -> str:
        """Rank 0: the drafter as an HF folder at `<checkpoint.dir>/drafter` (uploaded when a URI)."""
        import tempfile

        from app.model.export import export_drafter
        from app.storage import is_uri, open_storage

        root = self.cfg.checkpoint.dir
        if not is_uri(root):
            out = os.path.join(root, "drafter")
            export_drafter(self.trainer.drafter, self.arch, out, dtype=self.dtype)  # engines load bf16 on GPU
            return out
        with tempfile.TemporaryDirectory() as tmp:
            export_drafter(self.trainer.drafter, self.arch, tmp, dtype=self.dtype)
            return open_storage(root).upload_dir(Path(tmp), "drafter", last="config.json")

    def weights_checksum(self) -> float:
        with torch.no_grad():
            return float(sum(p.double().sum() + (p.double() ** 2).sum() for p in self.trainer.drafter.parameters()))

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
