"""The `runs:` list: several drafter runs on one capture stream (the same data, schedule and targets).

Each entry names a run and overrides what may differ between drafters sharing a stream: its `drafter`
and `train` keys, its drafter GPU count (`drafters`, ranks of its own group) and the target layers it
reads. Absent or empty: one run, as before. `run_config` turns the root config and one entry into that
run's own `Config` (its checkpoint folder `<checkpoint.dir>/runs/<name>`), through the sections' own
checks, so a bad override fails with the section's one line.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from app.config.drafter_sections import DrafterConfig, TrainConfig
from app.config.values import fail

RUNS_FOLDER = "runs"  # each run's checkpoints, export and summary: <checkpoint.dir>/runs/<name>
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# A run may not change these: every run trains on the one schedule the targets produce.
_SHARED_TRAIN = ("epochs",)


@dataclass(frozen=True)
class RunSpec:
    """One drafter run on the shared stream."""

    name: str = MISSING  # its label (metrics' drafter_run, summary) and its folder under <checkpoint.dir>/runs/
    drafters: int = 0  # drafter ranks (GPUs) of its group; 0 = topology.num_drafters
    drafter: dict[str, Any] = field(default_factory=dict)  # drafter.* keys that differ from the root's
    train: dict[str, Any] = field(default_factory=dict)  # train.* keys that differ (not epochs: the schedule is shared)
    target_layer_ids: list[int] = field(default_factory=list)  # empty = model.target_layer_ids (or DFlash's default)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name) or ".." in self.name:
            fail("runs[].name", self.name, "must be 1-64 letters, digits, '_', '.' or '-' (it names a folder), "
                 "starting with a letter or digit")
        if self.drafters < 0:
            fail(f"runs[{self.name}].drafters", self.drafters, "must be >= 0 (0 = topology.num_drafters)")
        _check_keys(f"runs[{self.name}].drafter", self.drafter, DrafterConfig, ())
        _check_keys(f"runs[{self.name}].train", self.train, TrainConfig, _SHARED_TRAIN)
        if any(i < 0 for i in self.target_layer_ids):
            fail(f"runs[{self.name}].target_layer_ids", list(self.target_layer_ids), "must be layer indices >= 0")


def _check_keys(key: str, overrides: dict[str, Any], section: type, shared: tuple[str, ...]) -> None:
    names = {f.name for f in dataclasses.fields(section)}
    for k in overrides:
        if k not in names:
            fail(key, dict(overrides), f"has no key {k!r}; it may set {', '.join(sorted(names - set(shared)))}")
        if k in shared:
            fail(key, dict(overrides), f"may not set {k!r}: every run trains on the one schedule the targets "
                 f"produce; set it at the top level instead")


def check_runs(runs, topology, rebalance: str, max_length: int, drafter: DrafterConfig, train: TrainConfig) -> None:
    """Checks across the list and the root config (Config.__post_init__): names unique, each run's
    sections valid, no automatic re-split (the split between targets and several groups is fixed)."""
    names = [r.name for r in runs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        fail("runs", names, f"name {dupes[0]!r} more than once; give each run its own name (it names its folder)")
    if runs and rebalance == "auto":
        fail("topology.rebalance", rebalance, "cannot re-split targets and drafters of several runs (runs: has "
             f"{len(runs)}); set topology.rebalance=advise or off")
    for r in runs:
        try:  # the sections' own checks, their messages prefixed with the run
            d = dataclasses.replace(drafter, **r.drafter)
            dataclasses.replace(train, **r.train)
        except ValueError as exc:
            raise ValueError(f"runs[{r.name}].{exc}") from None
        if max_length < 2 * d.block_size:
            fail(f"runs[{r.name}].drafter.block_size", d.block_size,
                 f"needs data.max_length >= {2 * d.block_size} (now {max_length}); lower it or raise data.max_length")


def run_folder(root: str, name: str) -> str:
    """<root>/runs/<name>, for a local path or a URI (a URI's ?query stays at its end)."""
    base, sep, query = str(root).partition("?")
    return f"{base.rstrip('/')}/{RUNS_FOLDER}/{name}{sep}{query}"


def sweep_drafters(cfg) -> int:
    """Drafter ranks of every run together: the placement group's drafter bundles."""
    return sum(run_drafters(r, cfg.topology) for r in cfg.runs) if cfg.runs else cfg.topology.num_drafters


def run_drafters(spec: RunSpec, topology) -> int:
    return spec.drafters or topology.num_drafters


def run_config(cfg, spec: RunSpec):
    """The Config one run of a sweep trains with: its drafter and train overrides, its drafter count
    (topology.num_drafters) and its own checkpoint folder; an empty `runs` list inside (it is one run)."""
    return dataclasses.replace(
        cfg, runs=[],
        drafter=dataclasses.replace(cfg.drafter, **spec.drafter),
        train=dataclasses.replace(cfg.train, **spec.train),
        topology=dataclasses.replace(cfg.topology, num_drafters=run_drafters(spec, cfg.topology)),
        checkpoint=dataclasses.replace(cfg.checkpoint, dir=run_folder(cfg.checkpoint.dir, spec.name)),
        model=dataclasses.replace(cfg.model, target_layer_ids=list(spec.target_layer_ids or cfg.model.target_layer_ids)),
    )


def sweep_root(cfg):
    """The root config of a sweep as the placement sees it: each run's drafter count resolved, and
    topology.num_drafters their sum (every run's ranks get a bundle). One run: `cfg` as is."""
    if not cfg.runs:
        return cfg
    runs = [dataclasses.replace(r, drafters=run_drafters(r, cfg.topology)) for r in cfg.runs]
    return dataclasses.replace(cfg, runs=runs, topology=dataclasses.replace(cfg.topology, num_drafters=sum(
        r.drafters for r in runs)))
