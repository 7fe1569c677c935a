"""Config checks that need the world outside the config: the filesystem, the target model, the cluster.

Value checks live in the schema's sections (`app/config/schema.py` and the section modules it
composes). Here: `check_paths` (run by the loader), `check_target` (run when the run is planned,
before Ray starts) and `check_resources` (run once Ray is connected, before any actor starts). They
take plain values (no Ray, no model weights), so tests call them directly. The topology's bundles and
what they reserve in all (`actor_bundles`, `reserved_resources`) are computed here once, for this
check, the placement check and the driver.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from app.config.errors import ConfigError
from app.config.drafter_sections import resolve_layer_ids
from app.config.layer_checks import check_layers
from app.config.schema import Config, TopologyConfig
from app.config.tiny_section import TINY_TARGET


def check_paths(cfg: Config) -> None:
    """The target folder, the training files and the eval prompts exist."""
    from app.config.gguf_names import check_gguf_target, is_gguf_target

    if is_gguf_target(cfg.model.target):  # a .gguf file or the embedded SmolLM2: converted once when resolved
        check_gguf_target(cfg.model.target)
    elif cfg.model.target != TINY_TARGET and not Path(cfg.model.target).is_dir():
        raise ConfigError(
            f"model.target={cfg.model.target!r} does not exist; give a Hugging Face model folder, a .gguf file, "
            "'smollm2-135m-instruct' or 'tiny'"
        )
    if cfg.model.target != TINY_TARGET and not cfg.data.train_files:
        raise ConfigError("data.train_files=[] is empty; list JSONL/Parquet files (only model.target=tiny generates data)")
    for i, f in enumerate(cfg.data.train_files):
        if not Path(f).exists():
            raise ConfigError(f"data.train_files[{i}]={f!r} does not exist; fix the path")
    if cfg.data.eval_prompts and not Path(cfg.data.eval_prompts).is_file():
        raise ConfigError(f"data.eval_prompts={cfg.data.eval_prompts!r} does not exist; fix the path or set it to ''")
    check_replay_root(cfg.pool.replay)


def check_replay_root(replay: str) -> None:
    """A pool.replay folder or URI that cannot hold a store (unknown scheme, no such bucket, a folder that
    cannot be made) stops the run here, before any actor; `local` is each node's own cache folder."""
    from app.storage.roots import redact, root_problem

    if replay not in ("off", "local") and (problem := root_problem(replay)) is not None:
        raise ConfigError(f"pool.replay={redact(replay)!r} cannot hold the replay store: {problem}; "
                          "fix it, or set pool.replay=off")


@dataclass(frozen=True)
class TargetInfo:
    """What the checks need to know about the target model."""

    num_layers: int
    vocab_size: int
    hidden_size: int
    pad_token_id: int | None
    eos_token_ids: tuple[int, ...]
    mask_token_id: int | None  # the tokenizer's own mask token, if it has one
    head_dim: int = 0  # the attention head width the drafter copies (0 = unknown)


def read_target_info(model_dir: str | Path) -> TargetInfo:
    """Read layer count, vocabulary and special ids from a HF folder without loading weights."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model.target={str(model_dir)!r} has no config.json; give a Hugging Face model folder")
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)  # multimodal wrappers keep the LM settings nested
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    pad, mask = cfg.get("pad_token_id"), None
    tok_path = model_dir / "tokenizer_config.json"
    if tok_path.is_file():
        tok = json.loads(tok_path.read_text())
        added = _added_token_ids(model_dir, tok)
        pad = pad if pad is not None else added.get(tok.get("pad_token"))
        mask = added.get(tok.get("mask_token"))
        eos_tok = added.get(tok.get("eos_token"))
        if eos_tok is not None and eos_tok not in eos_ids:
            eos_ids = eos_ids + (eos_tok,)
    return TargetInfo(
        num_layers=int(cfg["num_hidden_layers"]),
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        pad_token_id=pad,
        eos_token_ids=eos_ids,
        mask_token_id=mask,
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg.get("num_attention_heads") or 1)),
    )


def _added_token_ids(model_dir: Path, tok: dict) -> dict[str, int]:
    """Special token text -> id: tokenizer_config.json's `added_tokens_decoder` (transformers 4 writes
    it), else tokenizer.json's `added_tokens` (all that transformers 5 writes, e.g. the tiny target's)."""
    if tok.get("added_tokens_decoder"):
        return {v.get("content"): int(k) for k, v in tok["added_tokens_decoder"].items()}
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return {}
    return {t.get("content"): int(t["id"]) for t in json.loads(path.read_text()).get("added_tokens", [])}


def resolved_layer_ids(cfg: Config, info: TargetInfo) -> list[int]:
    """`model.target_layer_ids`, or the DFlash default when it is empty (the drafter's own rule)."""
    return resolve_layer_ids(cfg.model.target_layer_ids, info.num_layers, cfg.drafter.num_layers)


def resolved_mask_token_id(cfg: Config, info: TargetInfo) -> int:
    """`drafter.mask_token_id`, or the tokenizer's mask token when it is -1."""
    if cfg.drafter.mask_token_id >= 0:
        return cfg.drafter.mask_token_id
    if info.mask_token_id is None:
        raise ConfigError(
            "drafter.mask_token_id=-1 (auto) but the target's tokenizer has no mask token; set "
            "drafter.mask_token_id to an unused embedding row (not pad or eos)"
        )
    return info.mask_token_id


def check_target(cfg: Config, info: TargetInfo) -> None:
    """Every drafter's layer ids as the engines read them (the root's and each run's of a sweep,
    app/config/layer_checks.py), mask token a real, non-special row, head_dim flex can run on CUDA."""
    check_layers(cfg, info.num_layers)
    check_head_dim(info.head_dim, cfg.topology.device != "cpu" and cfg.topology.gpus_per_drafter > 0)
    mask = resolved_mask_token_id(cfg, info)
    if not 0 <= mask < info.vocab_size:
        raise ConfigError(
            f"drafter.mask_token_id={mask} is outside the target's vocabulary of {info.vocab_size}; "
            "pick an unused row below that"
        )
    if mask == info.pad_token_id or mask in info.eos_token_ids:
        which = "pad" if mask == info.pad_token_id else "eos"
        raise ConfigError(
            f"drafter.mask_token_id={mask} is the target's {which} token; pick an unused row that is "
            "neither pad nor eos"
        )


MIN_FLEX_HEAD_DIM = 16  # compiled flex_attention on CUDA refuses narrower heads


def check_head_dim(head_dim: int, on_cuda: bool) -> None:
    """The drafter copies the target's head_dim; on CUDA its attention is compiled flex, which needs >= 16."""
    if on_cuda and 0 < head_dim < MIN_FLEX_HEAD_DIM:
        raise ConfigError(
            f"the target's head_dim={head_dim} is below {MIN_FLEX_HEAD_DIM}, which the drafter's compiled "
            "flex_attention on CUDA refuses; use a target with head_dim >= 16 or topology.device=cpu"
        )


def actor_bundles(topo: TopologyConfig, use_gpu: bool) -> list[dict[str, float]]:
    """The placement group's bundles, one per actor, targets first: CPUs always, GPUs when the run uses them."""
    def bundle(cpus: float, gpus: float) -> dict[str, float]:
        return {"CPU": cpus, "GPU": gpus} if use_gpu and gpus > 0 else {"CPU": cpus}

    return ([bundle(topo.cpus_per_target, topo.gpus_per_target) for _ in range(topo.num_targets)]
            + [bundle(topo.cpus_per_drafter, topo.gpus_per_drafter) for _ in range(topo.num_drafters)])


def bundle_totals(bundles: list[dict[str, float]]) -> dict[str, float]:
    """Each resource summed over `bundles` (CPU and GPU always present)."""
    total = {"CPU": 0.0, "GPU": 0.0}
    for b in bundles:
        for k, v in b.items():
            total[k] = total.get(k, 0.0) + v
    return total


NIXL_INSTALL = "pip install 'dflash-ray[nixl]' (nixl==1.5.1, the wheels that bundle UCX)"


def nixl_installed() -> bool:
    """Whether the `nixl` package can be imported here (not imported: its agent starts only when used)."""
    return importlib.util.find_spec("nixl") is not None


def check_transport(transport: str, installed: bool | None = None) -> None:
    """`pool.transport=nixl` needs the nixl package in the driver's environment (the actors' too): refuse it
    before any actor starts, naming the fix."""
    if transport == "nixl" and not (nixl_installed() if installed is None else installed):
        raise ConfigError(f"pool.transport=nixl but the nixl package is not installed; {NIXL_INSTALL}, "
                          "or set pool.transport=object_store")


def reserved_resources(topo: TopologyConfig, use_gpu: bool) -> dict[str, float]:
    """What the actors' bundles reserve in all. The CPU count does not depend on `use_gpu`: what the
    cluster has beyond it is left to tokenizing (the driver's `spare_cpus`)."""
    return bundle_totals(actor_bundles(topo, use_gpu))


def check_resources(cfg: Config, available: dict[str, float], use_gpu: bool) -> None:
    """The placement group must fit the cluster: one bundle per actor. With `pool.transport=nixl`, the
    nixl package must be installed and the targets' memory must hold the unconsumed payloads."""
    check_transport(cfg.pool.transport)
    check_target_memory(cfg, available.get("memory", 0.0))
    topo = cfg.topology
    check_drafter_gpus(topo, use_gpu)
    reserved = reserved_resources(topo, use_gpu)
    if use_gpu:
        need = reserved["GPU"]
        have = available.get("GPU", 0.0)
        if need > have:
            raise ConfigError(
                f"topology asks for {need:g} GPUs (topology.num_targets={topo.num_targets} x "
                f"{topo.gpus_per_target:g} + topology.num_drafters={topo.num_drafters} x "
                f"{topo.gpus_per_drafter:g}) but the cluster has {have:g}; lower the counts or add GPUs"
            )
    need_cpu = reserved["CPU"]
    have_cpu = available.get("CPU", 0.0)
    if need_cpu > have_cpu:
        raise ConfigError(
            f"topology asks for {need_cpu:g} CPUs (topology.cpus_per_target={topo.cpus_per_target:g}, "
            f"topology.cpus_per_drafter={topo.cpus_per_drafter:g}) but the cluster has {have_cpu:g}; "
            "lower them (fractions are fine) or add nodes"
        )


def check_drafter_gpus(topo: TopologyConfig, use_gpu: bool) -> None:
    """Each drafter rank needs a GPU of its own: NCCL refuses two ranks of one group on one device (at the
    first collective, after the targets have loaded), and Ray packs fractional GPU shares onto one device.
    A run can hold two ranks with num_drafters >= 2, or with rebalance=auto (a re-split or extra GPUs add
    ranks). Ray also refuses a share above 1 that is not whole."""
    if use_gpu:
        check_target_gpus(topo.gpus_per_target)
    share = topo.gpus_per_drafter
    if not use_gpu or share <= 0:
        return
    if share > 1 and share != int(share):
        raise ConfigError(f"topology.gpus_per_drafter={share:g} is above 1 but not whole, which Ray refuses; "
                          f"give a whole number of GPUs per drafter (e.g. {int(share)} or {int(share) + 1})")
    several = topo.num_drafters >= 2 or topo.rebalance == "auto"
    if share < 1 and several:
        why = (f"topology.num_drafters={topo.num_drafters}" if topo.num_drafters >= 2 else
               "topology.rebalance=auto (a re-split or extra GPUs can add drafter ranks)")
        raise ConfigError(
            f"topology.gpus_per_drafter={share:g} with {why}: Ray can pack two drafter ranks onto one GPU, and "
            "NCCL refuses two ranks on one device at the first collective; set topology.gpus_per_drafter=1 (a "
            "GPU per rank), or topology.num_drafters=1 with topology.rebalance=off|advise")


def check_target_gpus(share: float, accelerate: bool | None = None) -> None:
    """A target over several GPUs (topology.gpus_per_target > 1) spreads its layers over them through
    accelerate's device map (app/devices.py plan_target_map): a whole number, and accelerate installed."""
    if share <= 1:
        return
    if share != int(share):
        raise ConfigError(f"topology.gpus_per_target={share:g} is above 1 but not whole, which Ray refuses; "
                          f"give a whole number of GPUs per target (e.g. {int(share)} or {int(share) + 1})")
    if not (importlib.util.find_spec("accelerate") is not None if accelerate is None else accelerate):
        raise ConfigError(f"topology.gpus_per_target={share:g} spreads each target over {share:g} GPUs with accelerate, "
                          "which is not installed; pip install accelerate, or set topology.gpus_per_target=1")


def check_target_memory(cfg: Config, heap_bytes: float) -> None:
    """`pool.transport=nixl` keeps every unconsumed payload (buffered, in flight, leased: what
    `pool.capacity_bytes` bounds) in the memory of the target that produced it, not in the object store;
    the cluster's worker memory (Ray's `memory` resource, 0 = Ray did not say) must hold that bound.
    All of them can sit on one target (the others busy or dead), so this is the cluster total, not a share."""
    if cfg.pool.transport != "nixl" or not heap_bytes or cfg.pool.capacity_bytes <= heap_bytes:
        return
    gib = 2**30
    raise ConfigError(
        f"pool.transport=nixl keeps up to pool.capacity_bytes={cfg.pool.capacity_bytes} "
        f"({cfg.pool.capacity_bytes / gib:.3g} GiB) of unconsumed hidden states in the targets' own memory, but the "
        f"cluster's worker memory is {heap_bytes / gib:.3g} GiB; lower pool.capacity_bytes, add memory, or set "
        "pool.transport=object_store"
    )


def leased_jobs(cfg: Config) -> int:
    """Jobs the drafters can hold leased at once: grad_accum of its step plus one prefetched, each."""
    return cfg.topology.num_drafters * (cfg.train.grad_accum + 1)


def check_step_fits(cfg: Config, job_bytes: int) -> None:
    """One global step must fit the byte budget: every drafter leases grad_accum jobs plus one
    prefetched, all counted in pool.capacity_bytes until acked. Less, and drafters hold part of a
    step each while the pool refuses more: steps shrink to what fits, or with one job above the cap,
    its bucket waits forever."""
    need = leased_jobs(cfg) * job_bytes
    if need > cfg.pool.capacity_bytes:
        raise ConfigError(
            f"pool.capacity_bytes={cfg.pool.capacity_bytes} is less than one global step needs: "
            f"{cfg.topology.num_drafters} drafters x (train.grad_accum={cfg.train.grad_accum} + 1 prefetched) jobs "
            f"of up to {job_bytes} bytes = {need}; raise pool.capacity_bytes to at least {need} or lower "
            f"data.tokens_per_job={cfg.data.tokens_per_job}"
        )
