"""The target layers a drafter reads, checked as the engines will read them, for every drafter a config trains.

`check_layers` applies one set of rules to `model.target_layer_ids` and to each run of a sweep
(`runs[<name>].target_layer_ids`, or what it inherits): inside the target, no repeats, ascending, not
the target's last layer. It runs in `check_target`, when the run is planned, before any actor starts;
each refusal is one line naming the key, its value and the fix.

Why each rule: vLLM and SGLang sort the ids (features would reach `fc` permuted against training) and
fail on repeats; the last layer's features are what the final norm is applied to: vLLM then feeds
un-normed features where training used normed ones (silently), SGLang errors and the speculators
converter drops it.
"""
from __future__ import annotations

from dataclasses import dataclass

from app.config.drafter_sections import resolve_layer_ids
from app.config.errors import ConfigError


@dataclass(frozen=True)
class LayerSource:
    """One drafter's target layers as the config gives them: `ids` under `key` ([] = DFlash's default
    spread for `draft_layers`, set under `draft_key`)."""

    key: str  # "model.target_layer_ids" or "runs[<name>].target_layer_ids"
    ids: tuple[int, ...]
    draft_key: str  # where its drafter's depth is set: "drafter.num_layers" or "runs[<name>].drafter.num_layers"
    draft_layers: int


def layer_sources(cfg) -> list[LayerSource]:
    """The root drafter's layers, then each run's whose layers differ from them: its own ids, or DFlash's
    default for its own depth when neither it nor model.target_layer_ids names any."""
    root = LayerSource("model.target_layer_ids", tuple(cfg.model.target_layer_ids), "drafter.num_layers",
                       cfg.drafter.num_layers)
    out = [root]
    for run in cfg.runs:
        key = f"runs[{run.name}]"
        depth = run.drafter.get("num_layers", cfg.drafter.num_layers)
        if run.target_layer_ids:
            out.append(LayerSource(f"{key}.target_layer_ids", tuple(run.target_layer_ids),
                                   f"{key}.drafter.num_layers", depth))
        elif not cfg.model.target_layer_ids and depth != cfg.drafter.num_layers:
            out.append(LayerSource(f"{key}.target_layer_ids", (), f"{key}.drafter.num_layers", depth))
    return out


def check_layers(cfg, num_layers: int) -> None:
    """Every drafter's layers of `cfg` (`layer_sources`) against a target of `num_layers` layers."""
    for source in layer_sources(cfg):
        check_layer_source(source, num_layers)


def check_layer_source(src: LayerSource, num_layers: int) -> None:
    """One drafter's layers: inside the target, no repeats, ascending, below the last layer."""
    for lid in src.ids:
        if not 0 <= lid < num_layers:
            raise ConfigError(f"{src.key}={list(src.ids)} has {lid}, outside the target's {num_layers} layers "
                              f"(0..{num_layers - 1}); use ids in that range or [] for the default")
    ids = resolve_layer_ids(src.ids, num_layers, src.draft_layers)
    what = (f"{src.key}={ids}" if src.ids else
            f"{src.key}=[] (the DFlash default for a {num_layers}-layer target and {src.draft_key}="
            f"{src.draft_layers} is {ids})")
    fix = ("list distinct ascending ids below the last layer" if src.ids else
           f"list distinct ascending ids below the last layer in {src.key}, or lower {src.draft_key}")
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise ConfigError(f"{what} repeats layer {repeated[0]}: vLLM and SGLang fail to load repeated target layer "
                          f"ids; {fix}")
    if ids != sorted(ids):
        raise ConfigError(f"{what} is not ascending: vLLM and SGLang sort the ids, so the features would reach fc "
                          f"permuted against training; write them as {sorted(ids)}")
    if num_layers - 1 in ids:
        raise ConfigError(f"{what} has {num_layers - 1}, the target's last layer: training reads its hidden state "
                          f"after the final norm, vLLM before it (silently wrong features), SGLang refuses it and the "
                          f"speculators converter drops it; {fix} (at most {num_layers - 2})")
