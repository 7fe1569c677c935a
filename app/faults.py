"""Fault injection from `faults.*`: each configured fault fires once per run directory.

A marker file created with O_EXCL makes "once" hold across processes and restarts: a restarted
target that gets the same job again does not die again.
"""
from __future__ import annotations

import os
from pathlib import Path


def fire_once(run_dir: str | Path, name: str) -> bool:
    """True the first time `name` is asked for under `run_dir`, False ever after.

    A URI `run_dir` (checkpoints on object storage) keeps its markers in a local folder tied to it:
    "once" then holds per machine, which is what single-machine rehearsals need."""
    from app.training.storage import local_cache_dir

    marks = local_cache_dir(run_dir) / "faults_fired"
    marks.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(marks / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True

