"""What one rank of the drafter group is given and hands back: `DrafterSetup` (built by the supervisor's
`DrafterGroup`, app/run/supervise/drafters.py), `DrafterResult` (what `DrafterActor.run` returns), and
`step_record`, the per-step report a rank sends the pool for the status line, the timeline and wandb.
Plain data, no Ray: the actor that uses them is `actors/drafter.py`.
"""
from __future__ import annotations

from dataclasses import dataclass

from app.config.drafter_sections import DrafterConfig, TrainConfig
from app.config.run_sections import CheckpointConfig, FaultsConfig
from app.messages import StepRecord


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
    max_payload_bytes: int = 0  # the run's largest job payload: the stager's pinned buffers, allocated once at it
    fence_token: int = 0  # the driver's lease token: rank 0 publishes under it, refused once a newer run holds the folder
    feature_layer_ids: list[int] | None = None  # a run of a sweep: the layers in each payload (layer_ids a subset)


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


def step_record(rank: int, step: int, epoch: int, stats, job_ids: tuple[int, ...], step_s: float,
                wait_s: float) -> StepRecord:
    """One rank's report of a step: the trainer's `stats` (app/training/trainer.py StepStats), the step's
    wall seconds `step_s` of which `wait_s` waited for data (the rest counts as compute)."""
    return StepRecord(
        rank=rank, step=step, epoch=epoch, loss=stats.loss, weight_sum=stats.weight_sum,
        correct=stats.accuracy, tokens=stats.local_tokens, accept_len=stats.accept_len,
        per_pos_acc=stats.per_pos_acc, topk_acc=stats.topk_acc, full_loss=stats.full_loss, compute_s=max(0.0, step_s - wait_s),
        data_wait_s=wait_s, lr=stats.lr, grad_norm=stats.grad_norm, job_ids=job_ids)
