"""`pool.replay` as the targets receive it: where the store is and how many bytes it may hold."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GIB = 2**30


@dataclass(frozen=True)
class ReplaySpec:
    """The replay store of a run: `location` is `local` (resolved on each node), an absolute folder or a URI."""

    location: str
    max_bytes: int
    writers: int = 1  # the run's targets: each checks the store's size again before it could overshoot much
    target: str = ""  # model.target as configured: a name for people in the manifest (the weights digest decides)


def replay_spec(cfg) -> ReplaySpec | None:
    """The run's replay spec from its `Config`, or None with `pool.replay: off`."""
    if cfg.pool.replay == "off":
        return None
    return ReplaySpec(location=cfg.pool.replay, max_bytes=int(cfg.pool.replay_max_gb * GIB),
                      writers=max(1, cfg.topology.num_targets), target=str(cfg.model.target))


def resolve_location(location: str) -> str:
    """`local` -> this node's private cache folder `<tmp>/dflash-<uid>/replay`; anything else as it is."""
    if location != "local":
        return location
    from app.storage.local_cache import cache_root

    path = Path(cache_root()) / "replay"
    path.mkdir(mode=0o700, exist_ok=True)
    return str(path)
