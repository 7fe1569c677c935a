"""Load a config: YAML merged onto the structured schema, CLI `key=value` on top, then checked.

Every user mistake becomes one `ConfigError` (a ValueError) whose message names the key, the value
and the fix; `app.train` prints it as one line and exits 2 before any actor starts.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from app.config.schema import TINY_TARGET, Config

CHOICES = {
    "model.dtype": ("bfloat16", "float16", "float32"),
    "topology.device": ("auto", "cuda", "cpu"),
    "data.format": ("auto", "openai", "sharegpt", "tokenized"),
    "data.overlong": ("truncate", "drop"),
    "data.on_error": ("raise", "skip"),
    "logging.wandb_mode": ("offline", "online", "disabled"),
}


class ConfigError(ValueError):
    """A user mistake in the config: the message is one line with the key, the value and the fix."""


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read `path` (or only the schema defaults), apply `key=value` overrides, validate, convert."""
    layers = [_read_yaml(path)] if path is not None else []
    layers.append(_parse_overrides(overrides))
    for layer in layers:
        _check_known_keys(layer, Config, prefix="")
    merged = _merge_onto_schema(layers)
    _check_missing(merged)
    cfg = typing.cast(Config, OmegaConf.to_object(merged))
    validate(cfg)
    return cfg


def _read_yaml(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {str(path)!r} does not exist; pass a YAML file such as conf/tiny.yaml")
    try:
        data = OmegaConf.to_container(OmegaConf.load(p), resolve=False)
    except (OmegaConfBaseException, ValueError) as exc:  # yaml errors surface as ValueError subclasses
        raise ConfigError(f"--config {str(path)!r} is not valid YAML ({_first_line(exc)}); fix the file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {str(path)!r} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not key=value; write e.g. train.lr=1e-3")
    try:
        return typing.cast(dict, OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides))))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"overrides {list(overrides)} could not be parsed ({_first_line(exc)})") from None


def _check_known_keys(layer: Any, schema: type, prefix: str) -> None:
    """Reject keys the schema does not have, suggesting the closest valid name."""
    if not isinstance(layer, dict):
        if prefix and dataclasses.is_dataclass(schema):
            raise ConfigError(f"{prefix[:-1]}={layer!r} must be a section (a mapping of keys), not a value")
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    for key, value in layer.items():
        full = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(_unknown_key_message(full, prefix, list(fields)))
        sub = hints[key]
        if dataclasses.is_dataclass(sub):
            _check_known_keys(value, sub, prefix=f"{full}.")


def _unknown_key_message(full: str, prefix: str, valid: list[str]) -> str:
    key = full[len(prefix):]
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if close:
        return f"unknown key {full!r}; did you mean '{prefix}{close[0]}'?"
    section = prefix[:-1] or "the top level"
    return f"unknown key {full!r}; valid keys in {section}: {', '.join(valid)}"


def _merge_onto_schema(layers: list[dict]) -> DictConfig:
    schema = OmegaConf.structured(Config)
    OmegaConf.set_readonly(schema, False)  # frozen dataclasses make the node read-only; merge needs writes
    merged = schema
    for layer in layers:
        try:
            merged = typing.cast(DictConfig, OmegaConf.merge(merged, layer))
        except OmegaConfBaseException as exc:
            raise ConfigError(_type_error_message(exc)) from None
    return merged


def _type_error_message(exc: OmegaConfBaseException) -> str:
    key = str(getattr(exc, "full_key", None) or "?")
    value = _offending_value(exc)
    want = _schema_type_name(key)
    return f"{key}={value!r} has the wrong type: expected {want}; fix the value in the YAML or on the command line"


def _offending_value(exc: OmegaConfBaseException) -> Any:
    msg = str(exc)
    if "Value '" in msg:
        return msg.split("Value '", 1)[1].split("'", 1)[0]
    return getattr(exc, "value", "?")


def _schema_type_name(dotted: str) -> str:
    """The annotated type of a schema key, for messages (`list[int]`, `int`, ...)."""
    tp: Any = Config
    for part in dotted.split("."):
        name, indexed = part.split("[", 1)[0], "[" in part
        if not dataclasses.is_dataclass(tp) or name not in {f.name for f in dataclasses.fields(tp)}:
            return "a value of the schema's type"
        tp = typing.get_type_hints(tp)[name]
        if indexed and typing.get_args(tp):
            tp = typing.get_args(tp)[0]
    if dataclasses.is_dataclass(tp):
        return "a section (mapping of keys)"
    return str(tp).replace("typing.", "") if typing.get_origin(tp) else tp.__name__


def _check_missing(merged: DictConfig) -> None:
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        key = missing[0]
        raise ConfigError(f"{key} is required but not set; set it in the YAML or pass {key}=VALUE")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def validate(cfg: Config) -> None:
    """Checks that need neither the target model nor the cluster."""
    _check_choices(cfg)
    _check_ranges(cfg)
    _check_buckets(cfg)
    _check_pool(cfg)
    _check_paths(cfg)


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _check_choices(cfg: Config) -> None:
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}; pick one of them")


# (key, minimum, why) for integer and float lower bounds.
_MINIMUMS = (
    ("topology.num_targets", 1, "at least one target must produce hidden states"),
    ("topology.num_drafters", 1, "at least one drafter must train"),
    ("train.grad_accum", 1, "it counts micro-batches per optimizer step"),
    ("drafter.block_size", 2, "a block is the anchor plus at least one predicted token"),
    ("drafter.num_layers", 1, "the drafter needs a layer"),
    ("drafter.num_anchors", 1, "each sequence needs at least one anchor"),
    ("drafter.ce_chunk_rows", 1, "the loss computes at least one row at a time"),
    ("train.epochs", 1, "train at least one epoch"),
    ("checkpoint.every_steps", 1, "checkpoints are written every N >= 1 steps"),
    ("checkpoint.keep", 1, "keep at least the latest checkpoint"),
    ("data.tokens_per_job", 1, "a job holds at least one token"),
    ("pool.capacity", 1, "the pool must hold at least one item"),
    ("pool.capacity_bytes", 1, "the pool needs a positive byte budget"),
    ("pool.min_ready", 1, "pulls wait for at least one buffered item"),
    ("pool.jobs_in_flight_per_target", 1, "a target with no job slot never works"),
    ("supervision.max_restarts_target", 0, "a budget cannot be negative"),
    ("supervision.max_restarts_drafter_group", 0, "a budget cannot be negative"),
)


def _check_ranges(cfg: Config) -> None:
    for key, minimum, why in _MINIMUMS:
        value = _get(cfg, key)
        if value < minimum:
            raise ConfigError(f"{key}={value!r} must be >= {minimum} ({why}); set {key}={minimum} or more")
    if not 0.0 <= cfg.train.warmup_ratio < 1.0:
        raise ConfigError(f"train.warmup_ratio={cfg.train.warmup_ratio} must be in [0, 1); the default is 0.04")
    if cfg.train.lr <= 0:
        raise ConfigError(f"train.lr={cfg.train.lr} must be > 0; the DFlash default is 6e-4")
    if cfg.drafter.loss_gamma < 0:
        raise ConfigError(f"drafter.loss_gamma={cfg.drafter.loss_gamma} must be >= 0 (0 = default for the block)")
    if cfg.data.max_length < 2 * cfg.drafter.block_size:
        raise ConfigError(
            f"data.max_length={cfg.data.max_length} is shorter than 2 x drafter.block_size="
            f"{cfg.drafter.block_size}; raise data.max_length"
        )
    for key in ("supervision.stall_timeout_s", "supervision.stop_timeout_s", "logging.status_every_s"):
        if _get(cfg, key) <= 0:
            raise ConfigError(f"{key}={_get(cfg, key)} must be > 0 seconds")


def _check_buckets(cfg: Config) -> None:
    bounds = list(cfg.data.bucket_boundaries)
    if not bounds:
        raise ConfigError("data.bucket_boundaries=[] is empty; give increasing upper lengths ending at data.max_length")
    for a, b in zip(bounds, bounds[1:]):
        if b <= a:
            raise ConfigError(
                f"data.bucket_boundaries={bounds} must be strictly increasing ({a} then {b}); sort them and drop repeats"
            )
    if bounds[-1] < cfg.data.max_length:
        raise ConfigError(
            f"data.bucket_boundaries={bounds} end at {bounds[-1]} and do not reach data.max_length="
            f"{cfg.data.max_length}; make the last boundary {cfg.data.max_length}"
        )
    if bounds[0] < 1:
        raise ConfigError(f"data.bucket_boundaries={bounds} must be positive lengths")


def _check_pool(cfg: Config) -> None:
    if cfg.pool.min_ready > cfg.pool.capacity:
        raise ConfigError(
            f"pool.min_ready={cfg.pool.min_ready} exceeds pool.capacity={cfg.pool.capacity}, so pulls would "
            f"wait forever; set pool.min_ready <= {cfg.pool.capacity}"
        )


def _check_paths(cfg: Config) -> None:
    if cfg.model.target != TINY_TARGET and not Path(cfg.model.target).is_dir():
        raise ConfigError(
            f"model.target={cfg.model.target!r} does not exist; give a Hugging Face model folder or 'tiny'"
        )
    if cfg.model.target != TINY_TARGET and not cfg.data.train_files:
        raise ConfigError("data.train_files=[] is empty; list JSONL/Parquet files (only model.target=tiny generates data)")
    for i, f in enumerate(cfg.data.train_files):
        if not Path(f).exists():
            raise ConfigError(f"data.train_files[{i}]={f!r} does not exist; fix the path")
    if cfg.data.eval_prompts and not Path(cfg.data.eval_prompts).is_file():
        raise ConfigError(f"data.eval_prompts={cfg.data.eval_prompts!r} does not exist; fix the path or set it to ''")
