"""What every bench shares: the repository root, the config a bench starts from with `key=value`
overrides, the `RESULT key=value ...` line (written and read back), a pool of worker processes, and
the bench's own Ray cluster.

The RESULT line is one line of space-separated `key=value` fields after the word RESULT, in the order
given; the README quotes these lines and tests parse them (`parse_result`), so a key holds no space and
no `=`, and a value no space.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository root (app/bench/common.py)
# conf/default.yaml's sizes and sections without its target and data files, which need not exist here.
SHAPES_ONLY = ("model.target=tiny", "data.train_files=[]")


# ---- the RESULT line ----------------------------------------------------------------------------------

def result_line(fields: Mapping[str, Any] | Iterable[tuple[str, Any]], digits: int = 3) -> str:
    """`RESULT k1=v1 k2=v2 ...`: a float prints with `digits` decimals, anything else as str() (format a
    value yourself for another precision)."""
    parts = []
    for key, value in (fields.items() if isinstance(fields, Mapping) else fields):
        text = f"{value:.{digits}f}" if isinstance(value, float) else str(value)
        if not key or any(c.isspace() or c == "=" for c in key) or not text or any(c.isspace() for c in text):
            raise ValueError(f"RESULT field {key!r}={text!r}: a key holds no space and no '=', a value no space")
        parts.append(f"{key}={text}")
    return "RESULT " + " ".join(parts)


def print_result(fields: Mapping[str, Any] | Iterable[tuple[str, Any]], digits: int = 3) -> str:
    """Print (and return) `result_line(fields)`, flushed: a bench's last word."""
    line = result_line(fields, digits)
    print(line, flush=True)
    return line


def parse_result(text: str) -> dict[str, str]:
    """The fields of the last RESULT line in `text` (a bench's whole output will do), as strings."""
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise ValueError("no RESULT line in the output")
    return dict(kv.split("=", 1) for kv in lines[-1].split()[1:])


# ---- configs and arguments ----------------------------------------------------------------------------

def add_overrides(ap: argparse.ArgumentParser, example: str = "train.epochs=2") -> None:
    """The trailing `key=value ...` config overrides a bench passes on to every run it makes."""
    ap.add_argument("overrides", nargs="*", help=f"key=value config overrides, as in app.train (e.g. {example})")


def bench_config(conf: str = "tiny", overrides: Sequence[str] = ()):
    """`conf/<conf>.yaml` of this repository with `overrides` applied in order (later ones win)."""
    from app.config.load import load_config

    return load_config(ROOT / "conf" / f"{conf}.yaml", list(overrides))


# ---- processes and the cluster --------------------------------------------------------------------------

def map_in_processes(fn: Callable, arg_lists: Sequence[Sequence[Any]], workers: int) -> list:
    """`[fn(*args) for args in arg_lists]`, run in up to `workers` fresh (spawned) processes at once;
    `workers` <= 1 runs them here, one after the other. `fn` must be importable by name."""
    if workers <= 1 or len(arg_lists) <= 1:
        return [fn(*args) for args in arg_lists]
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(min(workers, len(arg_lists)), mp_context=get_context("spawn")) as pool:
        return list(pool.map(fn, *zip(*arg_lists)))


def own_cluster(num_cpus: int | None = None, attempts: int = 3, **resources):
    """Start the bench's own local Ray cluster (`app.ray_cluster.start_own_cluster`: never one already on
    the machine or at RAY_ADDRESS, token auth) and return the ray module. `num_cpus` defaults to the
    machine's cores but at least 8 logical CPUs, so the tiny topology's 8 actors fit on a small box.
    Ray gives its new node 30 s to register, which a loaded box can miss: the processes that start left
    behind (its GCS, monitors; children of this process started by it) are ended and the start is tried
    again, `attempts` times in all."""
    import psutil
    import ray

    from app.ray_cluster import start_own_cluster

    me = psutil.Process()
    for attempt in range(1, attempts + 1):
        before = {p.pid for p in me.children(recursive=True)}
        try:
            start_own_cluster(num_cpus=num_cpus if num_cpus is not None else max(os.cpu_count() or 1, 8),
                              **resources)
            return ray
        except Exception as exc:  # Ray raises a bare Exception for this one
            if "timed out during startup" not in str(exc) or attempt == attempts:
                raise
            print(f"bench: Ray's node did not register in time (attempt {attempt} of {attempts}); starting again",
                  flush=True)
            ray.shutdown()
            _end([p for p in me.children(recursive=True) if p.pid not in before])
    raise AssertionError("unreachable")


def _end(procs: list) -> None:
    """Terminate these processes (by their ids), then kill those still alive after 10 s."""
    import psutil

    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    for p in psutil.wait_procs(procs, timeout=10)[1]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
