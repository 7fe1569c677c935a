"""Typed configuration: one frozen dataclass per section; the root `Config` composes them all.

Here: the root and the pipeline's sections (`model`, `topology`, `data`, `pool`). The tiny target's
section is `tiny_section.py`, the drafter's (`drafter`, `train`) `drafter_sections.py`, the run's
(`checkpoint`, `logging`, `supervision`, `faults`, `eval`) `run_sections.py`, the learning checks (`health`)
`health_section.py`.

The YAML files in `conf/` are merged onto this schema (see `app/config/load.py`), CLI `key=value`
overrides go on top, and the result is converted to these dataclasses. Each actor receives only its
own section.

Every value check lives once, in its section's `__post_init__` (which `OmegaConf.to_object`, a
direct construction and `dataclasses.replace` all run): a bad value raises a one-line ValueError
that starts with the dotted key (the helpers in `app/config/values.py`). Checks across sections sit in `Config.__post_init__`. Checks that
need the filesystem, the target model or the cluster live in `app/config/checks.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from app.config.drafter_sections import DrafterConfig, TrainConfig
from app.config.health_section import HealthConfig
from app.config.run_sections import CheckpointConfig, EvalConfig, FaultsConfig, LoggingConfig, SupervisionConfig
from app.config.sweep_section import RunSpec, check_runs
from app.config.tiny_section import TinyConfig
from app.config.values import at_least, fail, finite, one_of, positive
from app.storage.roots import has_credentials, is_uri


@dataclass(frozen=True)
class ModelConfig:
    """The frozen target model."""

    target: str = MISSING  # HF folder, or "tiny" for the built-in tiny target
    dtype: str = "bfloat16"  # bfloat16 | float16 | float32 (CPU runs promote to float32)
    target_layer_ids: list[int] = field(default_factory=list)  # empty = DFlash default
    feature_dtype: str = "bfloat16"  # features in transit: bfloat16 (as computed) | float8_e4m3 (half the bytes)

    def __post_init__(self) -> None:
        one_of("model.dtype", self.dtype, ("bfloat16", "float16", "float32"))
        one_of("model.feature_dtype", self.feature_dtype, ("bfloat16", "float8_e4m3"))


@dataclass(frozen=True)
class TopologyConfig:
    """How many actors of each kind and what each one gets."""

    num_targets: int = 5
    num_drafters: int = 3
    gpus_per_target: float = 1.0
    gpus_per_drafter: float = 1.0
    cpus_per_target: float = 2.0
    cpus_per_drafter: float = 4.0
    device: str = "auto"  # auto | cuda | cpu
    strategy: str = "PACK"  # placement group strategy: PACK | SPREAD (checked by app/run/placement.py)
    rebalance: str = "advise"  # off | advise (status line only) | auto (re-split at a checkpoint, app/run/elastic/resplit.py)
    rebalance_hold_s: float = 20.0  # the advice must hold this long before an auto re-split
    rebalance_min_gain: float = 0.15  # estimated tokens/s gain a re-split must beat (it costs a checkpoint and a rebuild)
    max_rebalances: int = 3  # auto re-splits per run, at most
    rebalance_half_life_s: float = 0.0  # 0: the advisor's rates since the start / last re-split; N: weighted by recency
    max_extra_gpus: float = 0.0  # 0: off; N (rebalance=auto): free GPUs up to N go to the short side (app/run/elastic/extra.py)

    def __post_init__(self) -> None:
        at_least("topology.num_targets", self.num_targets, 1, "at least one target must produce hidden states")
        at_least("topology.num_drafters", self.num_drafters, 1, "at least one drafter must train")
        for key, value in (("topology.gpus_per_target", self.gpus_per_target),
                           ("topology.gpus_per_drafter", self.gpus_per_drafter),
                           ("topology.cpus_per_target", self.cpus_per_target),
                           ("topology.cpus_per_drafter", self.cpus_per_drafter)):
            at_least(key, value, 0, "a reservation cannot be negative")
        one_of("topology.device", self.device, ("auto", "cuda", "cpu"))
        one_of("topology.strategy", self.strategy, ("PACK", "SPREAD"))
        if str(self.rebalance).lower() == "false":  # YAML 1.1 reads a bare `off` as a boolean (False)
            object.__setattr__(self, "rebalance", "off")
        one_of("topology.rebalance", self.rebalance, ("off", "advise", "auto"))
        finite("topology.rebalance_hold_s", self.rebalance_hold_s, "give seconds, e.g. 20")
        at_least("topology.rebalance_hold_s", self.rebalance_hold_s, 0, "a hold time cannot be negative")
        finite("topology.rebalance_min_gain", self.rebalance_min_gain, "give a share, e.g. 0.15")
        at_least("topology.rebalance_min_gain", self.rebalance_min_gain, 0, "a gain threshold cannot be negative")
        at_least("topology.max_rebalances", self.max_rebalances, 0, "0 turns automatic re-splits off")
        finite("topology.rebalance_half_life_s", self.rebalance_half_life_s, "give seconds, e.g. 60, or 0")
        at_least("topology.rebalance_half_life_s", self.rebalance_half_life_s, 0,
                 "0 measures since the start; a positive half-life weighs recent samples more")
        finite("topology.max_extra_gpus", self.max_extra_gpus, "give a GPU count, e.g. 2, or 0 (off)")
        at_least("topology.max_extra_gpus", self.max_extra_gpus, 0, "0 takes no GPUs beyond the topology's")
        if self.max_extra_gpus > 0 and self.rebalance != "auto":
            raise ValueError(f"topology.max_extra_gpus={self.max_extra_gpus:g} needs topology.rebalance=auto (the "
                             f"extra GPUs go to the side the split advisor names), not {self.rebalance!r}: set "
                             "topology.rebalance=auto, or topology.max_extra_gpus=0")


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
    tokens_per_job: int = 16384
    on_error: str = "raise"  # raise | skip
    seed: int = 0
    enable_thinking: bool = False
    eval_prompts: str = ""  # JSONL of held-out prompts; empty with target=tiny: generated
    num_workers: int = 0  # tokenizing workers: 0 = auto (1 for small inputs, else the cluster's spare CPUs), 1 = no Ray
    cache_dir: str = ""  # tokenized-data cache; "" = <checkpoint.dir>/data-cache (a URI run: <tmp>/dflash-<uid>/<run>/data-cache)

    def __post_init__(self) -> None:
        one_of("data.format", self.format, ("auto", "openai", "sharegpt", "tokenized"))
        one_of("data.overlong", self.overlong, ("truncate", "drop"))
        one_of("data.on_error", self.on_error, ("raise", "skip"))
        at_least("data.max_length", self.max_length, 1, "a sequence holds at least one token")
        at_least("data.tokens_per_job", self.tokens_per_job, 1, "a job holds at least one token")
        at_least("data.num_workers", self.num_workers, 0, "0 = auto, 1 = one process")
        bounds = list(self.bucket_boundaries)
        if not bounds:
            fail("data.bucket_boundaries", bounds, "is empty; give increasing upper lengths ending at data.max_length")
        for a, b in zip(bounds, bounds[1:]):
            if b <= a:
                fail("data.bucket_boundaries", bounds,
                      f"must be strictly increasing ({a} then {b}); sort them and drop repeats")
        if bounds[0] < 1:
            fail("data.bucket_boundaries", bounds, "must be positive lengths")
        if bounds[-1] < self.max_length:
            fail("data.bucket_boundaries", bounds,
                  f"end at {bounds[-1]} and do not reach data.max_length={self.max_length}; "
                  f"make the last boundary {self.max_length}")


@dataclass(frozen=True)
class PoolConfig:
    """The hidden-state pool between targets and drafters."""

    capacity: int = 24  # items (target jobs) buffered + in flight
    capacity_bytes: int = 32 * 2**30
    min_ready: int = 6
    jobs_in_flight_per_target: int = 2
    seed: int = 0
    metrics_every_s: float = 2.0
    pull_policy: str = "stratified"  # stratified | round_robin (app/pool/pull_policy.py)
    transport: str = "object_store"  # object_store | nixl: how payloads reach the drafters (app/payload/transport.py)
    replay: str = "off"  # off | local | an absolute folder or URI: the targets' features kept for replay (app/replay/)
    replay_max_gb: float = 100.0  # GiB the replay store may hold; past it nothing more is written

    def __post_init__(self) -> None:
        one_of("pool.pull_policy", self.pull_policy, ("stratified", "round_robin"))
        if str(self.replay).lower() == "false":  # YAML 1.1 reads a bare `off` as a boolean (False)
            object.__setattr__(self, "replay", "off")
        check_replay_setting(self.replay)
        positive("pool.replay_max_gb", self.replay_max_gb, " GiB")
        one_of("pool.transport", self.transport, ("object_store", "nixl"))
        at_least("pool.capacity", self.capacity, 1, "the pool must hold at least one item")
        at_least("pool.capacity_bytes", self.capacity_bytes, 1, "the pool needs a positive byte budget")
        at_least("pool.min_ready", self.min_ready, 0, "0 = pulls take whatever is buffered")
        if self.min_ready > self.capacity:
            fail("pool.min_ready", self.min_ready,
                  f"exceeds pool.capacity={self.capacity}, so pulls would wait forever; "
                  f"set pool.min_ready <= {self.capacity}")
        at_least("pool.jobs_in_flight_per_target", self.jobs_in_flight_per_target, 1,
                  "a target with no job slot never works")
        positive("pool.metrics_every_s", self.metrics_every_s, " seconds")


def check_replay_setting(value: str) -> None:
    """pool.replay: off, local (this node's cache folder), an absolute folder, or a URI without credentials."""
    if value in ("off", "local"):
        return
    if has_credentials(value):
        fail("pool.replay", "***", "carries credentials; give them in the environment (AWS variables, a profile)")
    if not (is_uri(value) or value.startswith("/")):
        fail("pool.replay", value, "is not off, local, an absolute folder or a URI (scheme://...); each actor "
             "would resolve a relative folder in its own working dir")


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
    health: HealthConfig = field(default_factory=HealthConfig)  # the drafter's learning checks (health_section.py)
    runs: list[RunSpec] = field(default_factory=list)  # several drafter runs on one stream (sweep_section.py)

    def __post_init__(self) -> None:
        check_runs(self.runs, self.topology, self.topology.rebalance, self.data.max_length, self.drafter, self.train)
        if self.data.max_length < 2 * self.drafter.block_size:
            fail("data.max_length", self.data.max_length,
                  f"is shorter than 2 x drafter.block_size={self.drafter.block_size}; raise data.max_length")
