"""Fault injection from `faults.*`: each configured fault fires once per run directory.

A marker file created with O_EXCL makes "once" hold across processes and restarts: a restarted
target that gets the same job again does not die again. The delays (`faults.target_delay_s`,
`faults.drafter_delay_s`) are not once: `injected_delay` adds them to every job of their side.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from app.storage.roots import local_cache_dir


def fire_once(run_dir: str | Path, name: str) -> bool:
    """True the first time `name` is asked for under `run_dir`, False ever after.

    A URI `run_dir` (checkpoints on object storage) keeps its markers in a local folder tied to it:
    "once" then holds per machine, which is what single-machine rehearsals need."""
    marks = _marks_dir(run_dir)
    marks.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(marks / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def _marks_dir(run_dir: str | Path) -> Path:
    """`<run_dir>/faults_fired`, or for a URI the same folder under the run's local cache dir."""
    return local_cache_dir(run_dir) / "faults_fired"


def sticky_target(run_dir: str | Path, target_id: int, sticky_id: int) -> bool:
    """Whether this incarnation of target `target_id` is the broken-but-alive one of
    `faults.sticky_target_error`: its first start under `run_dir` only (a restart is a fresh CUDA
    context, as resetting a GPU would give)."""
    return sticky_id >= 0 and target_id == sticky_id and fire_once(run_dir, f"sticky_target_{target_id}")


def injected_delay(seconds: float, sleep=time.sleep) -> None:
    """Wait `seconds` inside one job's measured work (0 = off): the side that waits is the slow side by
    construction, whatever the machine's speed or load (tests of the split advice rely on it)."""
    if seconds > 0:
        sleep(seconds)
