"""The run's sections: where checkpoints go and how often (`checkpoint`), the status line and wandb
(`logging`), restart budgets and the watchdog (`supervision`), fault injection (`faults`) and the
acceptance-length measurement (`eval`).
"""
from __future__ import annotations

from dataclasses import dataclass

from app.config.values import at_least, fail, one_of, positive
from app.storage.roots import has_credentials, redact


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often checkpoints are written."""

    dir: str = "runs/default"
    every_steps: int = 500
    keep: int = 3
    lease_timeout_s: float = 120.0  # a run lease not refreshed for this long is stale: another run may take it
    # A URI run's downloads (checkpoint versions, exports) each node keeps, over all runs there: least recently
    # used go first, never one a process is reading (app/storage/local_cache.py).
    download_cache_gb: float = 25.0
    export_dtype: str = "bfloat16"  # drafter/ weights: engines serve bf16 (an fp32 export is twice the size, cast anyway)
    # The target drafter-speculators/config.json names (what `vllm serve <dir>/drafter-speculators` loads) and the
    # launch lines serve: a hub id or a path on the serving machine; empty: model.target's folder, absolute.
    verifier: str = ""

    def __post_init__(self) -> None:
        one_of("checkpoint.export_dtype", self.export_dtype, ("bfloat16", "float16", "float32"))
        if self.verifier != self.verifier.strip() or has_credentials(self.verifier):
            fail("checkpoint.verifier", redact(self.verifier), "is not a hub id (Qwen/Qwen3-8B) or a path: remove the "
                 "surrounding spaces or credentials (it is written into drafter-speculators/config.json)")
        at_least("checkpoint.every_steps", self.every_steps, 1, "checkpoints are written every N >= 1 steps")
        at_least("checkpoint.keep", self.keep, 1, "keep at least the latest checkpoint")
        at_least("checkpoint.lease_timeout_s", self.lease_timeout_s, 10.0,
                  "the driver refreshes its lease every quarter of it; shorter is easily missed on a busy node")
        positive("checkpoint.download_cache_gb", self.download_cache_gb, " GB (a few checkpoint versions must fit)")
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
    # After a node loss: how long a drafter group rebuild waits for Ray to place the lost node's bundles again (a
    # spare node, an autoscaler) before it goes on with fewer ranks.
    bundle_wait_s: float = 90.0
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
        positive("supervision.bundle_wait_s", self.bundle_wait_s, " seconds")


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
    # The split advisor charges each side its injected delay (per forward, per micro-batch) instead of its measured
    # time: a bench's re-split then follows the delays, not how the machine's scheduler shares the CPU.
    virtual_clock: bool = False

    def __post_init__(self) -> None:
        for key in ("target_delay_s", "drafter_delay_s"):
            seconds = getattr(self, key)
            if not 0.0 <= seconds < float("inf"):  # nan fails every comparison
                fail(f"faults.{key}", seconds, f"must be a finite number of seconds >= 0; set faults.{key}=0 to turn it off")
        if self.virtual_clock and not (self.target_delay_s > 0 and self.drafter_delay_s > 0):
            fail("faults.virtual_clock", True, "charges each side its injected delay, so both must be > 0: set "
                 "faults.target_delay_s and faults.drafter_delay_s, or faults.virtual_clock=false")


@dataclass(frozen=True)
class EvalConfig:
    """Acceptance-length measurement on held-out prompts."""

    num_prompts: int = 64
    max_new_tokens: int = 256
    every_steps: int = 500  # optimizer steps between evaluations during the run (0 = off; tau_trained is measured anyway)
    timeout_s: float = 900.0  # one tau measurement on one target (during the run or at its end); past it, skipped
    race_prompts: int = 4  # held-out prompts the end of the run times speculative vs plain greedy decoding on (0 = off)

    def __post_init__(self) -> None:
        at_least("eval.num_prompts", self.num_prompts, 0, "a count cannot be negative")
        at_least("eval.race_prompts", self.race_prompts, 0, "use 0 to turn the end-of-run speed race off")
        at_least("eval.every_steps", self.every_steps, 0, "use 0 to turn evaluation during the run off")
        at_least("eval.max_new_tokens", self.max_new_tokens, 1, "tau needs at least one generated token")
        if not 0 < self.timeout_s < float("inf"):  # a range test: nan fails it too (nan would never time out)
            fail("eval.timeout_s", self.timeout_s, "must be a finite number of seconds > 0; e.g. eval.timeout_s=900")
