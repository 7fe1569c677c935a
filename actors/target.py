"""TargetActor: a frozen target LM that turns a job's sequences into drafter features.

A thin shell: the job's forward (padding or packing, the host copy) lives in `app/data/target_forward.py`,
features in `app/model/target_trunk.py` (the decoder runs only up to the deepest requested layer). The pool calls `forward` with `num_returns=2`, so
the small `ItemMeta` and the large `HiddenBatch` become two objects owned by the pool, and the payload
outlives this process.

On CUDA the actor runs with `max_concurrency = pool.jobs_in_flight_per_target` (see `target_concurrency`):
forwards take turns under one lock, while the job that just finished waits for its pinned host copy
outside it, so the copy overlaps the next job's forward. On CPU one call at a time, as before.

With `pool.replay` on, a job whose sequences are all in the replay store is served from it without a
forward, and a forwarded job's features are written there (`app/replay/target_side.py`); the target counts
its forwards and replay hits itself (`self.counts`, saved under `<run dir>/replay-counts/`).
"""
from __future__ import annotations

import contextlib

import os
import threading
import time

from app.data.target_forward import start_job
from app.config.run_sections import FaultsConfig
from app.config.schema import ModelConfig
from app.devices import compute_dtype, limit_threads, load_target, pick_device
from app.faults import fire_once, injected_delay, sticky_target
from app.messages import HiddenBatch, ItemMeta, JobSpec
from app.model.health import FeatureCache
from app.model.drafter_tau import EvalSpec
from app.payload.transport import HeldPayloads, put_payload, warm_up_nixl
from app.replay.key import payload_dtype
from app.replay.target_side import TargetCounts, TargetReplay, save_counts


class TargetActor:
    """Frozen HF causal LM on one GPU, spread over its bundle's GPUs (gpus_per_target > 1), or a CPU share;
    forward only."""

    def __init__(self, target_id: int, model_dir: str, layer_ids: list[int], model_cfg: ModelConfig,
                 device: str, num_cpus: float, dataset, faults: FaultsConfig, run_dir: str,
                 transport: str = "object_store", replay=None) -> None:
        limit_threads(num_cpus)
        if faults.fail_target_restarts and not fire_once(run_dir, f"target_started_{target_id}"):
            raise RuntimeError(f"injected fault: target {target_id} cannot start again (faults.fail_target_restarts)")
        self.target_id, self.layer_ids, self.dataset = target_id, list(layer_ids), dataset
        self.feature_dtype = model_cfg.feature_dtype  # FP8 in transit: encoded on the device (app/model/feature_codec.py)
        self.faults, self.run_dir = faults, run_dir
        self.sticky = sticky_target(run_dir, target_id, faults.sticky_target_error)  # raises on every job
        self.device = pick_device(device)
        self.dtype = compute_dtype(model_cfg.dtype, self.device)
        self.model_dir = model_dir
        # Straight onto the GPU; over every GPU of its bundle when topology.gpus_per_target > 1 (app/devices.py).
        self.model = load_target(model_dir, self.device, self.dtype)
        self.model.requires_grad_(False)
        from app.model.target_trunk import TargetTrunk

        self.trunk = TargetTrunk(self.model, self.layer_ids)
        self.compute_lock = threading.Lock()  # one forward at a time; host copies wait outside it
        self.busy = BusyClock()
        self.jobs_done = 0
        # pool.transport=nixl: payloads stay here until acked and drafters read them directly (app/payload/transport.py)
        self.transport, self.held = transport, HeldPayloads()
        if transport == "nixl":
            warm_up_nixl()  # seconds once per process: while loading, not on the first job
        # Plain greedy outputs of the eval prompts: the target is frozen, so they are computed once
        # and every later evaluation checks against them for free (app/model/spec_decode.py).
        self.greedy_references: dict = {}
        self.health_features = FeatureCache()  # the learning checks' target features, kept the same way
        # pool.replay: a job whose sequences are all stored skips the forward (app/replay/target_side.py)
        self.counts, self.replay = TargetCounts(), None
        if replay is not None:
            self.replay = TargetReplay.open(replay, model_dir, self.layer_ids,
                                            payload_dtype(self.feature_dtype, self.dtype))

    def ping(self) -> int:
        return self.target_id

    def forward_count(self) -> int:
        """Forwards this incarnation ran (replay hits not counted): a sweep's forwards per job are counted here."""
        return self.counts.forwards

    def forward(self, job: JobSpec) -> tuple[ItemMeta, HiddenBatch]:
        """Hidden states of `hidden_states[l + 1]` for each configured layer, per sequence of the job."""
        self._maybe_inject_fault(job)
        seqs = [self.dataset.sequence(i) for i in job.seq_indices]
        t0 = time.perf_counter()
        batch = self.replay.lookup(job.job_id, seqs) if self.replay else None
        if batch is None:
            batch, t0 = self._forward(job, seqs)
        else:
            self.counts.replay_hits += 1
        if self.replay:
            save_counts(self.run_dir, self.target_id, self.counts)
        meta = ItemMeta(
            job_id=job.job_id, bucket=job.bucket, num_seqs=len(seqs), num_tokens=int(batch.lengths_B.sum()),
            loss_tokens=int(batch.loss_mask_BS.sum()), nbytes=batch_nbytes(batch), target_id=self.target_id,
            forward_s=self.busy.share(t0),
        )
        if self.transport == "nixl":  # the pool holds the small NixlPayload; the tensors stay in this process
            payload, tensors = put_payload(batch)
            self.held.add(job.job_id, tensors)
            return meta, payload
        return meta, batch

    def _forward(self, job: JobSpec, seqs: list) -> tuple[HiddenBatch, float]:
        with self.compute_lock:
            t0 = time.perf_counter()
            injected_delay(self.faults.target_delay_s)  # counted in forward_s, as a slower GPU would be
            pending = start_job(self.trunk, seqs, job.job_id, self.device, feature_dtype=self.feature_dtype)
            self.jobs_done += 1
            self.counts.forwards += 1
        batch = pending.result()  # CUDA: waits for the pinned copy while the next job computes
        if self.replay:
            self.replay.keep(batch)
        return batch, t0

    def payloads_held(self) -> tuple[list[int], int]:
        """pool.transport=nixl: (job ids, bytes) of the payloads this target still holds for drafters."""
        return self.held.held()

    def _maybe_inject_fault(self, job: JobSpec) -> None:
        if self.sticky:  # within milliseconds, as a sticky CUDA error does
            raise RuntimeError("injected fault: CUDA error: an illegal memory access was encountered "
                               f"(faults.sticky_target_error={self.target_id})")
        if job.index == self.faults.poison_job and job.epoch == 0:  # every time, on every target
            raise IndexError(f"injected fault: job {job.job_id} is poison (faults.poison_job)")
        if job.index == self.faults.kill_target_at_job and job.epoch == 0 and fire_once(self.run_dir, "kill_target"):
            os._exit(1)  # a hard crash, as a GPU falling off would look
        if job.index == self.faults.stall_target_at_job and job.epoch == 0 and fire_once(self.run_dir, "stall_target"):
            time.sleep(10**6)  # a hang: only the watchdog gets us out

    def evaluate_weights(self, step: int, weights, spec: EvalSpec, best_dir: str | None = None,
                         beat_tau: float = float("inf")) -> dict:
        """tau and per-position acceptance of drafter weights at `step`, checked against plain greedy
        decoding: rank 0's numpy state dict during the run (`eval.every_steps`), an exported folder, or
        None for a fresh drafter (the end of the run uses this same method). Exported to `best_dir` when
        tau > `beat_tau`. See app/model/drafter_tau.py."""
        from dataclasses import replace

        from app.model.export import export_dtype
        from app.model.drafter_tau import background_priority, evaluate_drafter, export_best

        if isinstance(weights, list):  # rank 0's weights as a ref (app/run/evaluate/final_tau.py ask_tau): fetched here,
            import ray  # so a full store or a timed-out fetch is tried again instead of failing the evaluation

            from app.training.retry import transient_object_errors, with_retries

            weights = with_retries(lambda: ray.get(weights[0]), transient_object_errors())
        # The pool pauses this target's jobs (the ones it held finish first); on CPU the evaluation
        # yields the cores to training.
        lowered = background_priority(self.device) if spec.background else contextlib.nullcontext()
        with self.compute_lock, lowered:
            result, drafter, arch = evaluate_drafter(self.model, self.model_dir, spec.layer_ids or self.layer_ids, step,
                                                     weights, spec, self.device, self.dtype, self.greedy_references,
                                                     self.health_features)
        exported = export_best(drafter, arch, best_dir, step, result.tau, export_dtype(spec.export_dtype)) \
            if best_dir and result.tau > beat_tau else None  # None too when a better best landed meanwhile
        if exported is not None:
            result = replace(result, exported_to=str(exported))
        return result.to_dict()


    def race_weights(self, folder: str, spec: EvalSpec) -> dict:
        """Speculative decoding with the drafter exported to `folder` against this target alone, batch 1, timed
        side by side on the spec's first eval.race_prompts prompts (`app.model.drafter_tau.race_exported`). Asked
        at the end of the run, when no job competes for the cores, so it runs at normal priority."""
        from app.model.drafter_tau import race_exported

        with self.compute_lock:
            return race_exported(self.model, self.model_dir, spec.layer_ids or self.layer_ids, folder, spec, self.device,
                                 self.dtype).to_dict()


class BusyClock:
    """A target's busy seconds, job by job, with overlapping jobs never counting the same second twice
    (tokens / forward_s stays a true rate)."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock, self.lock, self.last_done = clock, threading.Lock(), 0.0

    def share(self, t0: float) -> float:
        """The job that started at `t0` and ends now: from its start or the previous job's end, whichever is later."""
        with self.lock:
            now = self.clock()
            busy = max(0.0, now - max(t0, self.last_done))
            self.last_done = now
        return busy


def target_concurrency(device_setting: str, use_gpu: bool, jobs_in_flight: int) -> int:
    """Concurrent `forward` calls: the jobs in flight on GPU (copy/compute overlap), one on CPU."""
    return max(1, jobs_in_flight) if use_gpu and device_setting != "cpu" else 1


def batch_nbytes(batch: HiddenBatch) -> int:
    """The payload's object-store bytes (what the pool's byte budget counts): every array, FP8 scales too."""
    arrays = (batch.hidden_BSD, batch.input_ids_BS, batch.loss_mask_BS, batch.lengths_B, batch.hidden_scale_BS)
    return int(sum(a.nbytes for a in arrays if a is not None))
