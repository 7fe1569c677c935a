"""A drafter's tau (acceptance length): its weights in, tau and per-position acceptance out.

The math the target actor runs for every tau measurement of a run (`TargetActor.evaluate_weights`),
during it and at its end alike: build the drafter (fresh, from a state dict - numpy, what rank 0 put
in the object store - or from an exported folder), run greedy speculative decoding with the target on
the held-out prompts up to the target's EOS (`EvalSpec`), check the output equals plain greedy, and,
when asked, export the drafter as the new best one, atomically. `python -m app.evaluate` measures
with the same `measure_spec`, so every tau the project reports comes from one piece of code.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

# config.json key holding where the exported drafter came from (step, tau); loaders ignore unknown keys.
META_KEY = "dflash_ray_eval"
# Niceness added to the evaluating thread on CPU where the idle scheduling class is refused.
CPU_EVAL_NICE = 19  # the lowest priority: weight 15 against 1024 for a training thread at 0


@dataclass(frozen=True)
class EvalSpec:
    """What every tau measurement of a run decodes with: the held-out prompts, the drafter and eval
    settings, the mask token and init seed of a fresh drafter, the EOS decoding stops at, and the dtype
    a new best is exported in (`checkpoint.export_dtype`, as `drafter/` is: what the engines serve)."""

    prompts: list[list[int]]
    drafter: Any  # app.config.drafter_sections.DrafterConfig
    eval: Any  # app.config.run_sections.EvalConfig
    mask_token_id: int
    seed: int
    eos_token_id: int | None
    export_dtype: str = "bfloat16"
    # On CPU, measure in the idle scheduling class (`background_priority`): during the run training has the cores.
    # The end of the run measures with False: idle-class threads get no CPU at all while anything else runs.
    background: bool = True
    # The target layers the drafter reads; None = the target's own. A run of a sweep reads a subset of the
    # union its targets capture (app/run/sweep.py), and its drafter is built for its own layers.
    layer_ids: tuple[int, ...] | None = None
    # The learning checks beside tau (app/model/health.py): app.config.health_section.HealthConfig, None = none,
    # and the fixed training sample they fit on: (prompt ids, response ids) pairs (`health.fit_sample`).
    health: Any = None
    fit: tuple = ()


def stop_token(eos_token_ids: tuple[int, ...]) -> int | None:
    """The EOS tau decoding stops at: the target's first eos_token_id (None when it has none)."""
    return eos_token_ids[0] if eos_token_ids else None


@dataclass(frozen=True)
class TauMeasurement:
    """One measurement of a drafter's tau at a training step, on a live target (while the run trains, or at its
    end): tau, per-position acceptance (positions 1..B-1), and whether it was exported."""

    step: int
    tau: float
    per_pos_accept: list[float]
    matches_greedy: bool
    num_prompts: int
    new_tokens: int
    seconds: float
    exported_to: str | None = None
    lossless: bool = True  # no acceptance bug (on an fp32 CPU target: equal to greedy); warn only when False
    mismatch_rate: float = 0.0  # share of prompts differing from plain greedy (bf16 near-tie flips on a GPU)
    # The learning checks (`check_health`): Health's figures, `verdicts` (one line each), `status` (ok or the
    # first verdict's name); None when the spec asks for none.
    health: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def weights_to_numpy(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """A float32 numpy copy of a module's state dict: what rank 0 puts in the object store (readers
    get it zero-copy; float32 because the master weights are float32 and numpy has no bf16)."""
    module = getattr(module, "module", module)  # DDP wrapper
    return {k: v.detach().to("cpu", torch.float32).numpy().copy() for k, v in module.state_dict().items()}


def per_position_acceptance(tokens_per_forward: list[int], block_size: int) -> list[float]:
    """Share of verify forwards that accepted draft position k, for k = 1..B-1.

    A forward that produced n tokens accepted its first n - 1 drafts (the last token is the target's
    own). The final forward of a prompt may be cut by max_new_tokens: it counts as what it kept."""
    if not tokens_per_forward:
        return [0.0] * (block_size - 1)
    accepted = np.asarray(tokens_per_forward) - 1
    return [float((accepted >= k).mean()) for k in range(1, block_size)]


@contextlib.contextmanager
def background_priority(device):
    """On CPU, run the body in the idle scheduling class (this thread only), so an evaluation takes
    only the cycles training leaves idle; on a GPU the evaluating target is off training anyway.

    SCHED_IDLE rather than a nice value: a woken training thread preempts an idle-class thread at
    once, while a niced one keeps the core until its slice ends, and gloo's collectives wake ranks
    many times a step (nice +10 and +19 both cost tiny's training 15-25% here). Where SCHED_IDLE is
    refused the thread is niced instead. Restoring needs CAP_SYS_NICE (root has it); without it the
    thread stays lowered, which only slows this target's later CPU forwards, never a result."""
    if getattr(device, "type", str(device)) != "cpu" or not hasattr(os, "setpriority"):
        yield
        return
    tid = threading.get_native_id()
    policy, nice = os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):  # AttributeError: a platform without SCHED_IDLE
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, min(19, nice + CPU_EVAL_NICE))
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, nice)


def evaluate_drafter(target_model, model_dir: str, layer_ids: list[int], step: int, weights, spec: EvalSpec,
                     device, dtype, references: dict | None = None,
                     health_cache=None) -> tuple[TauMeasurement, torch.nn.Module, object]:
    """(result, drafter, arch) for `weights` at `step`. `references`: the target's greedy outputs kept
    across evaluations (`measure_tau`); `health_cache`: the target's features the checks read, kept likewise
    (`app.model.health.FeatureCache`)."""
    import time

    t0 = time.perf_counter()
    drafter, head, arch = drafter_for(weights, model_dir, layer_ids, spec, device, dtype)
    references = {} if references is None else references  # the checks read the greedy outputs tau decoded
    res = measure_spec(target_model, drafter, head, arch, spec, references)
    health = check_health(target_model, drafter, head, spec, references, step, float(res.tau), health_cache)
    result = TauMeasurement(step=step, tau=float(res.tau),
                            per_pos_accept=per_position_acceptance(res.accepted_per_forward, arch.block_size),
                            matches_greedy=bool(res.matches_greedy), lossless=bool(res.lossless),
                            mismatch_rate=float(res.mismatch_rate), num_prompts=res.num_prompts,
                            new_tokens=res.new_tokens, seconds=time.perf_counter() - t0, health=health)
    return result, drafter, arch


def check_health(target_model, drafter, head, spec: EvalSpec, references: dict, step: int, tau: float,
                 cache=None) -> dict | None:
    """The learning checks of one evaluation (`app.model.health`), on the prompts tau was just decoded on (their
    greedy outputs from `references`) and the spec's training sample: figures, verdict lines and the status word."""
    if spec.health is None or not spec.health.enabled:
        return None
    from app.model.health import measure_health, status_word, verdicts
    from app.model.spec_decode import greedy_reference

    heldout = []
    for prompt in spec.prompts[: spec.eval.num_prompts]:
        key = (tuple(prompt), spec.eval.max_new_tokens, spec.eos_token_id)
        if key not in references:  # measure_spec keeps every one it decodes; only a caller's own dict lacks one
            references[key] = greedy_reference(target_model, prompt, spec.eval.max_new_tokens, spec.eos_token_id)
        heldout.append((list(prompt), references[key]))
    with torch.no_grad():
        h = measure_health(target_model, drafter, head, step, tau, heldout, list(spec.fit), spec.eval.max_new_tokens,
                           cache)
    found = verdicts(h, spec.health)
    return {**h.to_dict(), "verdicts": [v.line for v in found], "names": [v.name for v in found],
            "status": status_word(found)}


def drafter_for(weights, model_dir: str, layer_ids: list[int], spec: EvalSpec, device, dtype):
    """(drafter, head, arch): `weights` None is a fresh drafter (the spec's seed), a path an exported
    folder, else a numpy state dict (rank 0's weights from the object store)."""
    from app.model.build import build_or_load_drafter

    folder = weights if isinstance(weights, (str, os.PathLike)) else None
    drafter, head, arch = build_or_load_drafter(model_dir, folder, spec.drafter, layer_ids, spec.mask_token_id,
                                                device, dtype, spec.seed)
    if weights is not None and folder is None:
        drafter.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in weights.items()})  # copies: the store is read-only
    return drafter.eval(), head, arch


def measure_spec(target_model, drafter, head, arch, spec: EvalSpec, references: dict | None = None):
    """The one tau measurement (`EvalResult`): the spec's prompts and token budget, stopping at its EOS."""
    from app.model.spec_decode import measure_tau

    with torch.no_grad():
        return measure_tau(target_model, drafter, head, spec.prompts[: spec.eval.num_prompts],
                           spec.eval.max_new_tokens, list(arch.target_layer_ids), arch.block_size,
                           spec.eos_token_id, references=references)


@dataclass(frozen=True)
class RaceLine:
    """The end of the run's speed race (`race_exported`): what a user of the exported drafter gets at batch 1."""

    prompts: int
    greedy_tok_s: float
    spec_tok_s: float
    speedup: float  # spec_tok_s / greedy_tok_s
    identical: bool  # speculative output equal to plain greedy, token for token, on every prompt
    tau: float  # tokens per verify forward in the timed speculative runs
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def race_exported(target_model, model_dir: str, layer_ids: list[int], folder: str, spec: EvalSpec, device,
                  dtype) -> RaceLine:
    """Speculative decoding with the drafter exported to `folder` against the target alone, on the spec's first
    `eval.race_prompts` held-out prompts, both at batch 1 on the target's KV cache, interleaved prompt by prompt
    after one warm-up (`app.model.spec_bench.race`), the outputs compared token for token."""
    import time

    from app.model.spec_bench import race

    t0 = time.perf_counter()
    drafter, head, arch = drafter_for(folder, model_dir, layer_ids, spec, device, dtype)
    res = race(target_model, drafter, head, spec.prompts[: spec.eval.race_prompts], spec.eval.max_new_tokens,
               list(arch.target_layer_ids), arch.block_size, spec.eos_token_id, warmup=1)
    return RaceLine(prompts=len(spec.prompts[: spec.eval.race_prompts]), greedy_tok_s=res.greedy_tok_s,
                    spec_tok_s=res.spec_tok_s, speedup=res.speedup, identical=res.identical, tau=res.tau,
                    seconds=time.perf_counter() - t0)


def export_best(drafter, arch, out_dir: str | Path, step: int, tau: float,
                dtype: torch.dtype | None = None) -> Path | None:
    """Export to `out_dir` with `{step, tau}` in config.json, replacing it all at once; None (nothing
    written) when the best there, read again at swap time, has a tau as high (an overdue evaluation)."""
    from app.model.export import export_drafter

    def write(tmp: Path) -> None:
        export_drafter(drafter, arch, tmp, dtype=dtype)
        _stamp(tmp, step, tau)

    return _publish_best(out_dir, write, tau)


def copy_as_best(src_dir: str | Path, out_dir: str | Path, step: int, tau: float) -> Path | None:
    """The same for an already exported folder (the final drafter/ when it is the best)."""
    def write(tmp: Path) -> None:
        shutil.copytree(src_dir, tmp, dirs_exist_ok=True)
        _stamp(tmp, step, tau)

    return _publish_best(out_dir, write, tau)


def read_best_meta(folder: str | Path) -> dict | None:
    """`{step, tau}` of an exported best drafter, or None."""
    path = Path(folder) / "config.json"
    return json.loads(path.read_text()).get(META_KEY) if path.exists() else None


def _publish_best(out_dir: str | Path, write, tau: float) -> Path | None:
    """Exchanged in atomically (app/model/export.py publish_export), unless the best already there is as good."""
    from app.model.export import publish_export

    def beaten(current: Path) -> bool:
        meta = read_best_meta(current)
        return meta is not None and float(meta["tau"]) >= tau

    return publish_export(out_dir, write, keep_existing=beaten)


def _stamp(folder: Path, step: int, tau: float) -> None:
    """`{step, tau}` into the folder's config.json (where the best drafter came from)."""
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg[META_KEY] = {"step": int(step), "tau": float(tau)}
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
