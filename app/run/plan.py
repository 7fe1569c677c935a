"""Everything the driver settles before any actor starts: target, checks, data, schedule, resume point.

The driver plans before `ray.init`: a bad target, a bad mask token, malformed data (`DataError`) or
an empty dataset stops the run before the cluster is touched. The exceptions: a large input that
`data.num_workers=0` tokenizes on the cluster (`spare_cpus` connects first), and the byte size of a
job's hidden states, which waits for the device (`RunPlan.use_device`) when `topology.device=auto`.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from app.training.checkpoint import latest_checkpoint, read_extra, read_ledger
from app.config.schema import Config
from app.config.checks import (TargetInfo, check_step_fits, check_target, read_target_info, resolved_layer_ids,
                               resolved_mask_token_id)
from app.config.errors import ConfigError
from app.data.schedule import ScheduledJobs
from app.storage import fence
from app.storage.roots import open_storage, redact


@dataclass
class RunPlan:
    """The resolved run: what every actor and the supervisor need."""

    cfg: Config
    model_dir: str
    info: TargetInfo
    layer_ids: list[int]
    mask_token_id: int
    dataset: object  # app.data.dataset.TokenizedDataset
    data_summary: dict
    jobs: ScheduledJobs  # every epoch, in schedule order: JobSpecs made on demand from compact arrays
    eval_prompts: list[list[int]]
    resume_from: str | None
    resume_step: int
    resume_ledger: list[int]
    total_steps: int
    bytes_per_token: int = 0  # 0 until use_device
    data_fingerprint: str = ""
    feature_layer_ids: list[int] | None = None  # a run of a sweep: the layers the targets capture (its own a subset)

    @property
    def jobs_remaining(self) -> int:
        return len(self.jobs) - len(set(self.resume_ledger))

    def use_device(self, on_gpu: bool) -> None:
        """Size every job's payload for the device (bf16/fp16 on GPU, fp32 on CPU) and check one global
        step of the largest fits the pool's byte budget."""
        self.bytes_per_token = bytes_per_token(self.cfg, self.info, self.layer_ids, on_gpu)
        self.jobs.est_bytes_per_token = self.bytes_per_token
        check_step_fits(self.cfg, self.jobs.max_payload_bytes())


def bytes_per_token(cfg: Config, info: TargetInfo, layer_ids: list[int], on_gpu: bool) -> int:
    """Object-store bytes per padded token: layers x hidden x (2 for bf16/fp16, 4 for fp32 on CPU) + int64
    id + uint8 mask. A job adds 8 bytes per sequence (`EpochJobs.payload_bytes`)."""
    from app.model.feature_codec import payload_width

    width, per_token = payload_width(cfg.model.feature_dtype, 4 if (not on_gpu or cfg.model.dtype == "float32") else 2)
    return len(layer_ids) * info.hidden_size * width + per_token + 9  # FP8: 1 byte + a float32 scale per token


def device_known(cfg: Config) -> bool | None:
    """Whether the run uses GPUs, when the config alone says so (None for topology.device=auto)."""
    return {"cpu": False, "cuda": True}.get(cfg.topology.device)


def plan_run(cfg: Config, on_gpu: bool | None = None, *, spare_cpus: Callable[[], float] | None = None,
             log: Callable[[str], None] = print, progress: bool = True) -> RunPlan:
    """Resolve the target, check the config against it, load or tokenize the data, schedule and find the
    resume point.

    `on_gpu` None: the device is not known yet; call `use_device` before starting actors. `spare_cpus`
    connects to the cluster and says what it has left for tokenizing (only a large input on a cache
    miss with data.num_workers=0 asks)."""
    from transformers import AutoTokenizer

    from app.data.dataset import load_eval_prompts
    from app.data.pipeline import load_or_tokenize
    from app.data.schedule import epoch_jobs
    from app.tiny.build import resolve_target

    target = resolve_target(cfg)
    info = read_target_info(target.model_dir)
    check_target(cfg, info)
    layer_ids, mask_id = resolved_layer_ids(cfg, info), resolved_mask_token_id(cfg, info)
    tokenizer = AutoTokenizer.from_pretrained(target.model_dir)
    dataset = load_or_tokenize(cfg, target.model_dir, tokenizer, target.train_files, spare_cpus=spare_cpus, log=log,
                               progress=progress, vocab_size=info.vocab_size)
    if len(dataset) == 0:
        raise ConfigError(f"data.train_files={target.train_files} gave no usable sequence; see the data summary "
                          "(too few loss tokens or malformed records) and fix the data or data.max_length")
    lengths = np.asarray(dataset.lengths())
    jobs = ScheduledJobs([epoch_jobs(lengths, cfg.data, epoch) for epoch in range(cfg.train.epochs)])
    prompts = (load_eval_prompts(target.eval_prompts_file, tokenizer, cfg.data.enable_thinking)
               if target.eval_prompts_file else [])
    fingerprint = data_fingerprint(dataset, cfg)
    resume = read_resume_point(cfg, jobs, fingerprint)
    plan = RunPlan(
        cfg=cfg, model_dir=target.model_dir, info=info, layer_ids=layer_ids, mask_token_id=mask_id,
        dataset=dataset, data_summary=dataset.summary.to_dict(), jobs=jobs, eval_prompts=prompts,
        resume_from=resume.path, resume_step=resume.step, resume_ledger=resume.ledger,
        total_steps=total_steps(cfg, jobs), data_fingerprint=fingerprint,
    )
    if on_gpu is not None:
        plan.use_device(on_gpu)
    return plan


def data_fingerprint(dataset, cfg: Config) -> str:
    """Hash of the tokenized data and the settings that turn it into jobs. A ledger of job ids only
    means something for the same data and schedule; train.epochs is left out, so a run may be extended."""
    import hashlib
    import json

    h = hashlib.sha256()
    for arr in (dataset.tokens, dataset.loss_mask, dataset.offsets):
        h.update(np.ascontiguousarray(arr).data)  # a view: the memory-mapped cache is hashed without a copy
    d = cfg.data
    # The target and its layers too: the same job ids over another target's features are other data.
    h.update(json.dumps([d.seed, d.tokens_per_job, list(d.bucket_boundaries), d.max_length, cfg.model.target,
                         list(cfg.model.target_layer_ids)]).encode())
    return h.hexdigest()[:16]


class ResumePoint(NamedTuple):
    """Where a run goes on from: its latest checkpoint (None: a fresh run), that step, the jobs it trained."""

    path: str | None
    step: int
    ledger: list[int]


def read_resume_point(cfg: Config, jobs: ScheduledJobs, fingerprint: str) -> ResumePoint:
    """The one place the resume point is read, for a single run and for each run of a sweep: the latest
    checkpoint of `cfg.checkpoint.dir`, refused when it holds other data or another schedule. A sweep run's
    own folder first gets its counter raised to the lease's token and the entries found there recorded
    (fence.extend, app/storage/claim.py), so a stale run's commit landing after this read is never the
    resume point of this run's drafter group rebuilds."""
    fence.extend(open_storage(cfg.checkpoint.dir))  # the leased root itself, or no lease: nothing to do
    ckpt = latest_checkpoint(cfg.checkpoint.dir)
    if not ckpt:
        return ResumePoint(None, 0, [])
    _check_same_data(cfg, ckpt, fingerprint)
    step, _, ledger = read_ledger(ckpt)
    # train.epochs lowered: the dropped epochs' ids are no jobs now
    return ResumePoint(str(ckpt), step, jobs.scheduled_only(ledger))


def total_steps(cfg: Config, jobs: ScheduledJobs) -> int:
    """The optimizer steps the LR schedule spans. Partial steps at drains add a few (one per drafter at
    most): the schedule must not hit zero LR before the end."""
    per_step = cfg.topology.num_drafters * cfg.train.grad_accum
    return math.ceil(len(jobs) / per_step) + cfg.topology.num_drafters


def _check_same_data(cfg: Config, ckpt: Path, fingerprint: str) -> None:
    saved = read_extra(ckpt).get("data_fingerprint")
    if saved and saved != fingerprint:
        raise ConfigError(
            f"checkpoint.dir={redact(cfg.checkpoint.dir)!r} holds a run on different data or a different schedule "
            f"(fingerprint {saved} != {fingerprint}: data files, data.seed, data.tokens_per_job, "
            "data.bucket_boundaries, data.max_length, model.target or model.target_layer_ids changed); restore them or use a new checkpoint.dir"
        )


def run_name(cfg: Config) -> str:
    """`logging.run_name`, or the checkpoint folder's name and a short digest of its absolute path (or
    URI): the wandb run and the `run` label of every metric. Two runs whose folders share a name
    (runs/a/exp, runs/b/exp) thus stay two runs; the same folder resumes under the same one."""
    import hashlib

    from app.storage.roots import is_uri, redact, root_name

    if cfg.logging.run_name:
        return cfg.logging.run_name
    root = cfg.checkpoint.dir
    where = redact(root).rstrip("/") if is_uri(root) else str(Path(root).resolve())
    return f"{root_name(cfg.checkpoint.dir)}-{hashlib.sha256(where.encode()).hexdigest()[:6]}"


def object_store_extras(plan: RunPlan) -> tuple[int, int]:
    """(dataset bytes, eval-offer bytes): what the run puts in the object store besides the pool's
    payloads. The tokenized dataset and every epoch's schedule are put once and read by every target;
    a run that evaluates during training (`eval.every_steps` > 0 and held-out prompts) holds up to
    `EVAL_COPIES` float32 copies of the drafter's weights (app/pool/holdings.py)."""
    from app.pool.holdings import eval_offer_bytes

    data = plan.dataset
    dataset = int(data.tokens.nbytes + data.loss_mask.nbytes + data.offsets.nbytes) + int(plan.jobs.nbytes)
    evaluating = plan.cfg.eval.every_steps > 0 and bool(plan.eval_prompts)
    weights = 0
    if evaluating:
        from app.model.build import drafter_state_bytes

        weights = drafter_state_bytes(plan.model_dir, plan.cfg.drafter, plan.layer_ids, plan.mask_token_id)
    return dataset, eval_offer_bytes(weights, evaluating)
