"""DrafterActor: one replica of the data-parallel drafter group, as a thin Ray shell.

The rank's step protocol (accumulate `train.grad_accum` micro-batches with one pull prefetched, the
step's single all-reduce, acks after the optimizer step, the all-gather of job ids into the ledger rank 0
checkpoints, drains and end-of-stream, checkpoint and eval cadence) is `app/training/loop.py`; its
operations (Ray calls, the trainer, the process group, the step log, the drafter faults, the phases the
supervisor's watchdog reads, rank 0's checkpoints) are `RankOps` in `actors/drafter_ops.py`, handed the
parts it uses and the rank's `RankState`. This module holds the rank: the process group's setup, the
trainer (`app/training/trainer.py`), the restore from a checkpoint and the export.
What a rank is given and returns is `app/training/drafter_io.py`.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from actors.drafter_ops import RankOps, RankState
from app.devices import compute_dtype, limit_threads, pick_device
from app.messages import DrafterPhase, DrafterProgress
from app.storage import fence
from app.training.checkpoint import load_checkpoint, restore_rng, state_checksum
from app.training.drafter_io import DrafterResult, DrafterSetup
from app.training.effects import LoopConfig
from app.training.loop import RankLoop, drive
from app.training.rendezvous import Rendezvous
from app.storage.local_cache import set_download_bound
from app.training.step_log import StepLog


class DrafterActor:
    """One rank of the drafter group (gloo on CPU, nccl on GPU)."""

    def __init__(self, rank: int, setup: DrafterSetup, pool) -> None:
        limit_threads(setup.num_cpus)
        self.rank, self.cfg, self.pool = rank, setup, pool
        fence.join(setup.checkpoint.dir, setup.fence_token)  # publishes under its run's lease token (app/storage/fence.py)
        set_download_bound(int(setup.checkpoint.download_cache_gb * 2**30))  # this node's download cache (local_cache.py)
        self.rendezvous = Rendezvous()
        self.step_log = StepLog(setup.step_log) if rank == 0 and setup.step_log else None  # rank 0 writes it
        self.device = pick_device(setup.device)
        self.dtype = compute_dtype(setup.dtype, self.device)
        self.state = RankState(rank)  # epoch, ledger, step and phase: what the step's operations change

    def progress(self) -> DrafterProgress:
        """Answered from a second actor thread while `run` trains (the actor has max_concurrency=2)."""
        return self.state.progress()

    def address(self) -> tuple[str, int]:
        """Rank 0's rendezvous address for torch.distributed: this node's address only (app/training/rendezvous.py)."""
        import ray

        return self.rendezvous.listen(ray.util.get_node_ip_address())

    def write_probe(self, name: str, token: str) -> str:
        """Rank 0 at group start: `token` into `<checkpoint.dir>/<name>`, for the driver to read back (both
        must see one folder, app/run/supervise/drafters.py `check_probe`). Returns where, on which node."""
        import ray

        from app.storage.roots import is_uri, open_storage

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
        # Pinned staging buffers sized to the run's largest payload, allocated (registered) once, here.
        self.stager = PayloadStager(self.device, self.dtype, copy_threads=staging_threads(self.cfg.num_cpus),
                                    max_bytes=self.cfg.max_payload_bytes)
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
        self.trainer.step, self.state.epoch, self.state.ledger = state.step, state.epoch, set(state.ledger)
        if state.rng:
            restore_rng(state.rng)

    def run(self) -> DrafterResult:
        """Train until every rank is dry or a stop is requested (the protocol: app/training/loop.py)."""
        import ray

        if self.device.type == "cuda":  # run may execute on another actor thread than setup did
            torch.cuda.set_device(self.device)
        # This incarnation's generation: pulls a dead predecessor sent are refused, not served.
        ops = RankOps(self.pool, ray.get(self.pool.generation.remote(self.rank)), self.cfg, self.trainer, self.stager,
                      self.device, self.dtype, self.state, self.step_log)
        c = self.cfg
        loop = RankLoop(LoopConfig(self.rank, c.world_size, c.train.grad_accum, c.checkpoint.every_steps,
                                   c.eval_every_steps, start_step=self.trainer.step))
        outcome = drive(loop, ops)
        ops.executor.shutdown(wait=False)
        ops.close()  # the staging and receive buffers, unless a pull is still in flight (then at exit)
        self.state.enter(DrafterPhase.COMPUTE)
        result = DrafterResult(self.rank, self.trainer.step, outcome.stopped, self.weights_checksum(), ops.last_ckpt,
                               self.export() if (self.rank == 0 and not outcome.stopped) else None,
                               outcome.nonfinite, ops.skipped)
        self.state.enter(DrafterPhase.DONE)
        return result

    def export(self) -> str:
        """Rank 0: the drafter as an HF folder at `<checkpoint.dir>/drafter` (uploaded when a URI)."""
        with fence.stop_when_fenced():  # another run holds the folder now: one line, and this rank ends
            return self._export()

    def _export(self) -> str:
        from app.model.export import export_drafter, export_dtype, publish_export
        from app.storage.roots import is_uri, open_storage

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
