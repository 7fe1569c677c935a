"""Typed configuration: one frozen dataclass per section.

The YAML files in `conf/` are merged onto this schema (see `app/config/load.py`), CLI
`key=value` overrides go on top, and the result is converted to these dataclasses. Each actor
receives only its own section.

Every value check lives once, in its section's `__post_init__` (which `OmegaConf.to_object`, a
direct construction and `dataclasses.replace` all run): a bad value raises a one-line ValueError
that starts with the dotted key (the helpers in `app/config/values.py`). Checks across sections sit in `Config.__post_init__`. Checks that
need the filesystem, the target model or the cluster live in `app/config/checks.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from app.config.values import at_least, fail, finite, one_of, positive
from app.storage.roots import has_credentials, redact

TINY_TARGET = "tiny"
# Token ids the tiny tokenizer reserves before its words (special tokens and role words);
# app/tiny/build.py asserts its vocabulary agrees.
TINY_RESERVED_TOKENS = 9
TINY_CORPORA = ("markov", "python")  # what the tiny target learns and generates its data from (app/tiny/)


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
class TinyConfig:
    """Settings of the built-in tiny target (used when model.target == "tiny")."""

    cache_dir: str = ".cache/tiny"  # where the tiny target and its data are built once
    corpus: str = "markov"  # markov (a word cycle: fast, easy) | python (this interpreter's stdlib, BPE)
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

    def __post_init__(self) -> None:
        one_of("tiny.corpus", self.corpus, TINY_CORPORA)
        if self.corpus == "python" and self.vocab_size < 300:  # 256 byte tokens + 6 specials + merges
            fail("tiny.vocab_size", self.vocab_size, "is too small for tiny.corpus=python's byte-level BPE; use at least 300")
        words = self.vocab_size - TINY_RESERVED_TOKENS
        if words < 16:
            fail("tiny.vocab_size", self.vocab_size, "is too small; use at least 64")
        for key, value in (("tiny.hidden_size", self.hidden_size), ("tiny.num_heads", self.num_heads),
                           ("tiny.num_kv_heads", self.num_kv_heads), ("tiny.num_layers", self.num_layers),
                           ("tiny.intermediate_size", self.intermediate_size)):
            at_least(key, value, 1, "the tiny target needs it")
        if self.hidden_size % self.num_heads:
            fail("tiny.hidden_size", self.hidden_size, f"must be a multiple of tiny.num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            fail("tiny.num_heads", self.num_heads, f"must be a multiple of tiny.num_kv_heads={self.num_kv_heads}")
        at_least("tiny.num_train_prompts", self.num_train_prompts, 1, "the tiny target generates the training data")
        at_least("tiny.num_eval_prompts", self.num_eval_prompts, 0, "a count cannot be negative")
        at_least("tiny.prompt_length", self.prompt_length, 1, "a prompt needs a word")
        at_least("tiny.response_length", self.response_length, 4, "responses are at least a quarter of it")
        if not 0.5 < self.chain_top_prob <= 1.0:  # a range test: nan and inf fail it too
            fail("tiny.chain_top_prob", self.chain_top_prob, "must be in (0.5, 1] so greedy follows the chain")
        if not 0 <= self.chain_words <= words or self.chain_words == 1:
            fail("tiny.chain_words", self.chain_words, f"must be 0 (all) or in [2, {words}]")
        at_least("tiny.lm_steps", self.lm_steps, 0, "0 keeps the target random")
        at_least("tiny.lm_batch_size", self.lm_batch_size, 1, "a training step needs a conversation")
        at_least("tiny.lm_response_length", self.lm_response_length, 1, "a training answer needs a word")
        positive("tiny.lm_lr", self.lm_lr)


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

    def __post_init__(self) -> None:
        one_of("pool.pull_policy", self.pull_policy, ("stratified", "round_robin"))
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


@dataclass(frozen=True)
class DrafterConfig:
    """The DFlash drafter architecture and its training sample."""

    num_layers: int = 5
    intermediate_size: int = 0  # MLP width of each draft layer; 0 = the target's (z-lab's drafters)
    block_size: int = 16
    num_anchors: int = 512
    loss_gamma: float = 0.0  # 0 = DFlash default for the block size (7 for 16, 5 for 10, 4 for 8)
    mask_token_id: int = -1  # -1 = the tokenizer's mask token (the tiny target reserves one); else an id >= 0
    ce_chunk_rows: int = 1024  # rows of the LM head computed at once in the loss
    max_rows: int = 65536  # query rows (blocks x block_size) per drafter sub-batch; 0 = a whole job at once

    def __post_init__(self) -> None:
        at_least("drafter.num_layers", self.num_layers, 1, "the drafter needs a layer")
        at_least("drafter.intermediate_size", self.intermediate_size, 0, "0 = the target's MLP width; else the width")
        at_least("drafter.block_size", self.block_size, 2, "a block is the anchor plus at least one predicted token")
        at_least("drafter.num_anchors", self.num_anchors, 1, "each sequence needs at least one anchor")
        at_least("drafter.loss_gamma", self.loss_gamma, 0, "0 = default for the block")
        if self.mask_token_id < -1:  # only -1 means auto; -2 is a typo, not a second auto
            fail("drafter.mask_token_id", self.mask_token_id, "must be -1 (the tokenizer's mask token) or an id >= 0")
        at_least("drafter.ce_chunk_rows", self.ce_chunk_rows, 1, "the loss computes at least one row at a time")
        at_least("drafter.max_rows", self.max_rows, 0, "0 = no bound; else rows per sub-batch")

    @property
    def gamma(self) -> float:
        """The loss decay the drafter trains with: `loss_gamma`, or for 0 DFlash's default for the block."""
        return self.loss_gamma or default_gamma(self.block_size)


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
    on_nonfinite: str = "stop"  # a step whose loss or grad norm is nan/inf: stop (no checkpoint of it) | skip

    def __post_init__(self) -> None:
        one_of("train.compile", self.compile, ("auto", "on", "off"))
        one_of("train.on_nonfinite", self.on_nonfinite, ("stop", "skip"))
        at_least("train.epochs", self.epochs, 1, "train at least one epoch")
        finite("train.lr", self.lr, "the DFlash default is 6e-4")
        if self.lr <= 0:
            fail("train.lr", self.lr, "must be > 0; the DFlash default is 6e-4")
        at_least("train.weight_decay", self.weight_decay, 0, "0 = none, the DFlash default")
        if not 0.0 <= self.warmup_ratio < 1.0:  # a range test: nan and inf fail it too
            fail("train.warmup_ratio", self.warmup_ratio, "must be in [0, 1); the default is 0.04")
        at_least("train.grad_accum", self.grad_accum, 1, "it counts micro-batches per optimizer step")
        positive("train.max_grad_norm", self.max_grad_norm)
        at_least("train.sample_every", self.sample_every, 0, "0 = never")


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often checkpoints are written."""

    dir: str = "runs/default"
    every_steps: int = 500
    keep: int = 3
    lease_timeout_s: float = 120.0  # a run lease not refreshed for this long is stale: another run may take it
    export_dtype: str = "bfloat16"  # drafter/ weights: engines serve bf16 (an fp32 export is twice the size, cast anyway)

    def __post_init__(self) -> None:
        one_of("checkpoint.export_dtype", self.export_dtype, ("bfloat16", "float16", "float32"))
        at_least("checkpoint.every_steps", self.every_steps, 1, "checkpoints are written every N >= 1 steps")
        at_least("checkpoint.keep", self.keep, 1, "keep at least the latest checkpoint")
        at_least("checkpoint.lease_timeout_s", self.lease_timeout_s, 10.0,
                  "the driver refreshes its lease every quarter of it; shorter is easily missed on a busy node")
        if has_credentials(self.dir):  # a key in the URI reaches wandb, log lines and error messages
            raise ValueError(f"checkpoint.dir={redact(self.dir)!r} holds credentials in the URI; remove them and set "
                             "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) on every node instead")


@dataclass(frozen=True)
class LoggingConfig:
    """Status line and wandb."""

    wandb_mode: str = "offline"  # offline | online | disabled
    wandb_project: str = "dflash-ray"
    run_name: str = ""  # empty = derived from checkpoint.dir; also the metrics' run label
    status_every_s: float = 10.0
    step_log: bool = False  # drafter rank 0 appends each step's job ids per rank to <checkpoint.dir>/steps.jsonl (app/training/step_log.py)

    def __post_init__(self) -> None:
        one_of("logging.wandb_mode", self.wandb_mode, ("offline", "online", "disabled"))
        positive("logging.status_every_s", self.status_every_s, " seconds")


@dataclass(frozen=True)
class SupervisionConfig:
    """Restart budgets and the watchdog."""

    max_restarts_target: int = 3
    max_restarts_drafter_group: int = 2
    max_restarts_pool: int = 3  # a dead pool is recreated from the latest checkpoint this often in one job
    stall_timeout_s: float = 600.0
    stop_timeout_s: float = 120.0
    broken_target_raises: int = 3  # a target whose forward raises this many times in a row is broken (restarted)
    max_quarantined_share: float = 0.01  # the run stops once more than this share of its jobs is quarantined

    def __post_init__(self) -> None:
        at_least("supervision.max_restarts_target", self.max_restarts_target, 0, "a budget cannot be negative")
        at_least("supervision.max_restarts_pool", self.max_restarts_pool, 0, "a budget cannot be negative")
        at_least("supervision.broken_target_raises", self.broken_target_raises, 2,
                  "1 would call a target broken for one poison job")
        if not 0.0 <= self.max_quarantined_share <= 1.0:  # a range test: nan fails it too
            fail("supervision.max_quarantined_share", self.max_quarantined_share,
                  "must be in [0, 1] (a share of the jobs); e.g. supervision.max_quarantined_share=0.01")
        at_least("supervision.max_restarts_drafter_group", self.max_restarts_drafter_group, 0,
                  "a budget cannot be negative")
        positive("supervision.stall_timeout_s", self.stall_timeout_s, " seconds")
        positive("supervision.stop_timeout_s", self.stop_timeout_s, " seconds")


@dataclass(frozen=True)
class FaultsConfig:
    """Fault injection for tests and rehearsals; -1 = off (the delays: 0 = off)."""

    kill_target_at_job: int = -1
    kill_drafter_at_step: int = -1
    stall_target_at_job: int = -1
    stall_drafter_at_step: int = -1  # the last rank hangs outside any collective at this step (or its stream's end)
    fail_target_restarts: bool = False  # every start of a target after its first in this run dir fails in __init__
    poison_job: int = -1  # the forward of this job (epoch 0, by schedule position) raises every time
    sticky_target_error: int = -1  # this target id's first incarnation raises on every job (a poisoned CUDA context)
    target_delay_s: float = 0.0  # seconds added to every target forward (0 = off): targets slow by construction
    drafter_delay_s: float = 0.0  # seconds added to every drafter micro-batch (0 = off): drafters slow by construction

    def __post_init__(self) -> None:
        for key in ("target_delay_s", "drafter_delay_s"):
            seconds = getattr(self, key)
            if not 0.0 <= seconds < float("inf"):  # nan fails every comparison
                fail(f"faults.{key}", seconds, f"must be a finite number of seconds >= 0; set faults.{key}=0 to turn it off")


@dataclass(frozen=True)
class EvalConfig:
    """Acceptance-length measurement on held-out prompts."""

    num_prompts: int = 64
    max_new_tokens: int = 256
    every_steps: int = 500  # optimizer steps between evaluations during the run (0 = off; tau_trained is measured anyway)
    timeout_s: float = 900.0  # one tau measurement on one target (during the run or at its end); past it, skipped

    def __post_init__(self) -> None:
        at_least("eval.num_prompts", self.num_prompts, 0, "a count cannot be negative")
        at_least("eval.every_steps", self.every_steps, 0, "use 0 to turn evaluation during the run off")
        at_least("eval.max_new_tokens", self.max_new_tokens, 1, "tau needs at least one generated token")
        if not 0 < self.timeout_s < float("inf"):  # a range test: nan fails it too (nan would never time out)
            fail("eval.timeout_s", self.timeout_s, "must be a finite number of seconds > 0; e.g. eval.timeout_s=900")


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

    def __post_init__(self) -> None:
        if self.data.max_length < 2 * self.drafter.block_size:
            fail("data.max_length", self.data.max_length,
                  f"is shorter than 2 x drafter.block_size={self.drafter.block_size}; raise data.max_length")


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


def resolve_layer_ids(layer_ids: list[int] | tuple[int, ...], n_target_layers: int, n_draft_layers: int) -> list[int]:
    """`layer_ids` as given, or DFlash's default spread when empty."""
    if layer_ids:
        return [int(i) for i in layer_ids]
    return default_target_layer_ids(n_target_layers, n_draft_layers)
