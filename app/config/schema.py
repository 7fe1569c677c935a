"""Typed configuration: one frozen dataclass per section.

The YAML files in `conf/` are merged onto this schema (see `app/config/load.py`), CLI
`key=value` overrides go on top, and the result is converted to these dataclasses. Each actor
receives only its own section. Checks that need no cluster live in `validate()` here; checks
against the target model and the cluster's resources live in `app/config/checks.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

TINY_TARGET = "tiny"


@dataclass(frozen=True)
class ModelConfig:
    """The frozen target model."""

    target: str = MISSING  # HF folder, or "tiny" for the built-in tiny target
    dtype: str = "bfloat16"  # bfloat16 | float16 | float32 (CPU runs promote to float32)
    target_layer_ids: list[int] = field(default_factory=list)  # empty = DFlash default


@dataclass(frozen=True)
class TinyConfig:
    """Settings of the built-in tiny target (used when model.target == "tiny")."""

    cache_dir: str = ".cache/tiny"  # where the tiny target and its data are built once
    hidden_size: int = 64
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512
    seed: int = 0
    num_train_prompts: int = 192
    num_eval_prompts: int = 8
    prompt_length: int = 12  # words per synthetic prompt
    response_length: int = 96  # tokens generated greedily per response
    chain_top_prob: float = 0.8  # the target is trained on a Markov chain: P(likely successor), rest = one other word
    chain_words: int = 128  # words on the chain's cycle that greedy text walks (0 = all); fewer = easier drafting
    lm_steps: int = 200  # AdamW steps that teach the target the chain before it generates the data (0 = random target)
    lm_batch_size: int = 8  # conversations per target training step
    lm_response_length: int = 48  # longest assistant turn (words) in the target's training conversations
    lm_lr: float = 1.0e-2  # target training peak learning rate


@dataclass(frozen=True)
class TopologyConfig:
    """How many actors of each kind and what each one gets."""

    num_targets: int = 5
    num_drafters: int = 3
    gpus_per_target: float = 1.0
    gpus_per_drafter: float = 1.0
    cpus_per_target: float = 1.0
    cpus_per_drafter: float = 1.0
    device: str = "auto"  # auto | cuda | cpu
    strategy: str = "PACK"  # placement group strategy: PACK | SPREAD (checked by app/run/placement.py)


@dataclass(frozen=True)
class DataConfig:
    """Training data, bucketing and job building."""

    train_files: list[str] = field(default_factory=list)  # empty with target=tiny: generated
    format: str = "auto"  # auto | openai | sharegpt | tokenized
    max_length: int = 3072
    overlong: str = "truncate"  # truncate | drop
    bucket_boundaries: list[int] = field(
        default_factory=lambda: [256, 512, 1024, 1536, 2048, 3072]
    )
    tokens_per_job: int = 8192
    on_error: str = "raise"  # raise | skip
    seed: int = 0
    enable_thinking: bool = False
    eval_prompts: str = ""  # JSONL of held-out prompts; empty with target=tiny: generated


@dataclass(frozen=True)
class PoolConfig:
    """The hidden-state pool between targets and drafters."""

    capacity: int = 24  # items (target jobs) buffered + in flight
    capacity_bytes: int = 32 * 2**30
    min_ready: int = 6
    jobs_in_flight_per_target: int = 2
    seed: int = 0
    metrics_every_s: float = 2.0


@dataclass(frozen=True)
class DrafterConfig:
    """The DFlash drafter architecture and its training sample."""

    num_layers: int = 5
    block_size: int = 16
    num_anchors: int = 512
    loss_gamma: float = 0.0  # 0 = DFlash default for the block size (7 for 16, 5 for 10, 4 for 8)
    mask_token_id: int = -1  # -1 = the tokenizer's mask token (the tiny target reserves one)
    ce_chunk_rows: int = 1024  # rows of the LM head computed at once in the loss
    max_rows: int = 65536  # query rows (blocks x block_size) per drafter sub-batch; 0 = a whole job at once


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation."""

    epochs: int = 6
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    grad_accum: int = 4
    max_grad_norm: float = 1.0
    sample_every: int = 50
    seed: int = 0
    compile: str = "auto"  # torch.compile the drafter layers: auto (on for CUDA, off for CPU) | on | off
    activation_checkpointing: bool = False  # recompute each drafter layer in backward instead of saving it


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often checkpoints are written."""

    dir: str = "runs/default"
    every_steps: int = 500
    keep: int = 3


@dataclass(frozen=True)
class LoggingConfig:
    """Status line and wandb."""

    wandb_mode: str = "offline"  # offline | online | disabled
    wandb_project: str = "dflash-ray"
    run_name: str = ""  # empty = derived from checkpoint.dir; also the metrics' run label
    status_every_s: float = 10.0


@dataclass(frozen=True)
class SupervisionConfig:
    """Restart budgets and the watchdog."""

    max_restarts_target: int = 3
    max_restarts_drafter_group: int = 2
    stall_timeout_s: float = 600.0
    stop_timeout_s: float = 120.0


@dataclass(frozen=True)
class FaultsConfig:
    """Fault injection for tests and rehearsals; -1 = off."""

    kill_target_at_job: int = -1
    kill_drafter_at_step: int = -1
    stall_target_at_job: int = -1


@dataclass(frozen=True)
class EvalConfig:
    """Acceptance-length measurement on held-out prompts."""

    num_prompts: int = 8
    max_new_tokens: int = 64


@dataclass(frozen=True)
class Config:
    """The whole tree."""

    model: ModelConfig = field(default_factory=ModelConfig)
    tiny: TinyConfig = field(default_factory=TinyConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def default_gamma(block_size: int) -> float:
    """DFlash's loss decay for a block size: 7 for 16, 5 for 10, 4 for 8 (interpolated otherwise)."""
    table = {16: 7.0, 10: 5.0, 8: 4.0}
    if block_size in table:
        return table[block_size]
    return max(1.0, 7.0 * block_size / 16)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """k layers spread uniformly from layer 1 to layer n-3 (e.g. [1, 9, 17, 25, 33] for 36, k=5)."""
    lo, hi = 1, max(1, num_target_layers - 3)
    k = num_draft_layers
    if k == 1:
        return [num_target_layers // 2]
    return [round(lo + i * (hi - lo) / (k - 1)) for i in range(k)]
