"""Progress bars for the long data steps (tokenizing, `app.prepare`, `app.regenerate`): records/s and ETA.

tqdm on stdout, so stderr keeps only errors (the one-line `data error: ...` of a bad record). On a
terminal the bar redraws twice a second; in a log (`ray job logs`, CI) it writes a line every 30 s.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from collections.abc import Iterator


@contextmanager
def progress_bar(total: int, desc: str, unit: str = "rec", enabled: bool = True) -> Iterator:
    """A tqdm bar (or a stand-in whose `update` does nothing when `enabled` is False)."""
    if not enabled:
        yield _Silent()
        return
    from tqdm import tqdm

    tty = sys.stdout.isatty()
    bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, file=sys.stdout, dynamic_ncols=tty,
               mininterval=0.5 if tty else 30.0, smoothing=0.1)
    try:
        yield bar
    finally:
        bar.close()


class _Silent:
    def update(self, n: int = 1) -> None:
        pass
