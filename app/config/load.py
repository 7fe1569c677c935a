"""Load a config: YAML merged onto the structured schema, CLI `key=value` on top, then converted.

    YAML file ─► merge onto OmegaConf.structured(Config) ─► merge the CLI overrides ─► to_object
                 (types, unknown keys)                                                (each section's
                                                                                        __post_init__)
    then `check_paths` (app/config/checks.py): the files the config names exist.

Both layers are read with YAML's safe loader (no `!!python/...` tags) and may interpolate only plain
`${section.key}` references: a resolver such as `${oc.env:AWS_SECRET_ACCESS_KEY}` would copy the
environment into the run name, the metrics' labels and wandb, so it is refused before anything resolves.

OmegaConf's own exceptions carry the offending key (`full_key`) and value; they become one
`ConfigError` each, built from those fields, never from OmegaConf's message text. A ValueError from
a section's `__post_init__` already starts with the dotted key and becomes a ConfigError as is.
`app.train` prints a ConfigError as one line and exits 2 before any actor starts.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

from app.config.checks import check_paths
from app.config.errors import ConfigError
from app.config.schema import Config

__all__ = ["ConfigError", "load_config"]

_REFERENCE = re.compile(r"\$\{[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*\}")  # ${section.key}, the one interpolation allowed


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read `path` (or only the schema defaults), apply `key=value` overrides, convert and check."""
    merged = OmegaConf.structured(Config)
    OmegaConf.set_readonly(merged, False)  # frozen dataclasses make the node read-only; merge needs writes
    if path is not None:
        merged = _merge(merged, _read_yaml(path))
    merged = _merge(merged, _parse_overrides(overrides))
    try:
        cfg = typing.cast(Config, OmegaConf.to_object(merged))
    except MissingMandatoryValue as exc:
        key = exc.full_key
        raise ConfigError(f"{key} is required but not set; set it in the YAML or pass {key}=VALUE") from None
    except ValueError as exc:  # a section's __post_init__: the message starts with the dotted key
        raise ConfigError(_one_line(exc)) from None
    check_paths(cfg)
    return cfg


def _read_yaml(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {str(path)!r} does not exist; pass a YAML file such as conf/tiny.yaml")
    try:
        data = OmegaConf.to_container(OmegaConf.load(p), resolve=False)
    except yaml.YAMLError as exc:  # syntax, and tags the safe loader refuses (!!python/object)
        raise ConfigError(f"--config {str(path)!r} is not valid YAML ({_yaml_problem(exc)}); fix the file") from None
    except (OmegaConfBaseException, ValueError, RecursionError) as exc:
        raise ConfigError(f"--config {str(path)!r} is not valid YAML ({_one_line(exc)}); fix the file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {str(path)!r} must hold a mapping of sections, got {type(data).__name__}")
    _refuse_resolvers(data, "")
    return data


def _parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not key=value; write e.g. train.lr=1e-3")
        try:  # each alone, so the error names the one that is not YAML
            OmegaConf.from_dotlist([item])
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r} is not valid YAML ({_yaml_problem(exc)}); fix or quote the value") from None
        except (OmegaConfBaseException, RecursionError):
            pass  # reported below with every override
    try:
        layer = typing.cast(dict, OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides))))
    except (OmegaConfBaseException, RecursionError) as exc:
        raise ConfigError(f"overrides {list(overrides)} could not be parsed ({_one_line(exc)})") from None
    _refuse_resolvers(layer, "")
    return layer


def _refuse_resolvers(layer: Any, key: str) -> None:
    """Every string in `layer` interpolates nothing but `${section.key}` references."""
    if isinstance(layer, dict):
        for k, v in layer.items():
            _refuse_resolvers(v, f"{key}.{k}" if key else str(k))
    elif isinstance(layer, list):
        for i, v in enumerate(layer):
            _refuse_resolvers(v, f"{key}[{i}]")
    elif isinstance(layer, str) and "${" in _REFERENCE.sub("", layer):
        raise ConfigError(f"{key}={layer!r} interpolates more than a ${{section.key}} reference; resolvers such as "
                          "${oc.env:...} are refused (they copy the environment into run names and logs): "
                          "write the value itself")


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What the YAML parser found and where, in one line."""
    problem = getattr(exc, "problem", None) or _one_line(exc)
    mark = getattr(exc, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def _merge(merged: DictConfig, layer: dict) -> DictConfig:
    """`layer` merged onto `merged`; a failure becomes a ConfigError naming the key and the value."""
    try:
        return typing.cast(DictConfig, OmegaConf.merge(merged, layer))
    except (OmegaConfBaseException, TypeError) as exc:
        if getattr(exc, "full_key", None):
            raise _merge_error(exc, str(exc.full_key), getattr(exc, "value", None)) from None
        failure = exc
    # A scalar given for a section, or a mapping for a list: OmegaConf names no key, so merge the
    # layer one leaf at a time to find it (only on this error path).
    for key, value in _leaves(layer, Config, ""):
        nested: Any = value
        for part in reversed(key.split(".")):
            nested = {part: nested}
        try:
            merged = typing.cast(DictConfig, OmegaConf.merge(merged, nested))
        except (OmegaConfBaseException, TypeError) as exc:
            raise _merge_error(exc, str(getattr(exc, "full_key", None) or key),
                               getattr(exc, "value", None) if getattr(exc, "full_key", None) else value) from None
    raise ConfigError(f"the config could not be merged onto the schema ({_one_line(failure)})")


def _merge_error(exc: BaseException, full_key: str, value: Any) -> ConfigError:
    if isinstance(exc, ConfigKeyError):  # full_key: the first key the schema does not have
        return ConfigError(_unknown_key_message(full_key))
    return ConfigError(f"{full_key}={value!r} has the wrong type: expected {_schema_type_name(full_key)}; "
                       "fix the value in the YAML or on the command line")


def _leaves(layer: dict, schema: Any, prefix: str) -> typing.Iterator[tuple[str, Any]]:
    """(dotted key, value) of every value that is not a mapping for a schema section."""
    hints = typing.get_type_hints(schema) if dataclasses.is_dataclass(schema) else {}
    for k, v in layer.items():
        sub = hints.get(k)
        if isinstance(v, dict) and dataclasses.is_dataclass(sub):
            yield from _leaves(v, sub, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _schema_field(dotted: str) -> tuple[type | None, list[str]]:
    """The schema type at `dotted` (None if the schema has no such key) and the field names of
    the deepest section on the way (for suggestions)."""
    tp: Any = Config
    names = [f.name for f in dataclasses.fields(Config)]
    for part in dotted.split("."):
        name, indexed = part.split("[", 1)[0], "[" in part
        if not dataclasses.is_dataclass(tp) or name not in names:
            return None, names
        tp = typing.get_type_hints(tp)[name]
        if indexed and typing.get_args(tp):
            tp = typing.get_args(tp)[0]
        if dataclasses.is_dataclass(tp):
            names = [f.name for f in dataclasses.fields(tp)]
    return tp, names


def _unknown_key_message(full: str) -> str:
    prefix, _, key = full.rpartition(".")
    _, valid = _schema_field(prefix) if prefix else (Config, [f.name for f in dataclasses.fields(Config)])
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if close:
        return f"unknown key {full!r}; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?"
    return f"unknown key {full!r}; valid keys in {prefix or 'the top level'}: {', '.join(valid)}"


def _schema_type_name(dotted: str) -> str:
    """The annotated type of a schema key, for messages (`list[int]`, `int`, ...)."""
    tp, _ = _schema_field(dotted)
    if tp is None:
        return "a value of the schema's type"
    if dataclasses.is_dataclass(tp):
        return "a section (mapping of keys)"
    return str(tp).replace("typing.", "") if typing.get_origin(tp) else tp.__name__


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
