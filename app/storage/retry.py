"""Transient storage errors retried with a bounded backoff, so a moment of object-store overload does not
end a save or a resume.

An object store answers overload or a failover with a 5xx (S3's `SlowDown` 503, `InternalError` 500) or
drops a connection mid-transfer; the next try a second later works. A checkpoint save that raised there
killed rank 0 (the group rebuilt from an older checkpoint) and a resume that raised failed the run's
start. Here each storage operation (one upload, one download, one listing, one delete) is tried again
after such an error: `ATTEMPTS` tries at most, waits of 0.5, 2 and 8 s (about 10 s in all), one line on
stderr per retry naming the operation, the error's kind and the attempt. Anything else is raised at once:
a missing object, a refused permission, a refused connection (a wrong endpoint does not heal; the S3
client has already retried it). Only `OSError`s are looked at (pyarrow raises its I/O errors as such).

`sleep` is looked up at each wait: the tests replace it with a virtual clock.
"""
from __future__ import annotations

import errno
import re
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
ATTEMPTS = 4
FIRST_S, FACTOR = 0.5, 4.0  # waits 0.5, 2, 8 s
# How pyarrow's S3/GCS clients word a 5xx, throttling or a transfer cut short (curl 28 timeout, 52 empty
# reply, 55/56 send/receive failure). A bare "503" is not looked for: it could be part of a key.
_MARKERS = re.compile(r"(?:HTTP status|status code|response code)\D{0,3}5\d\d|SLOW_DOWN|SlowDown|SERVICE_UNAVAILABLE|"
                      r"ServiceUnavailable|INTERNAL_FAILURE|InternalError|REQUEST_TIMEOUT|RequestTimeout|THROTTLING|"
                      r"Throttling|curlCode: (?:28|52|55|56)\b|Connection reset")
_ERRNOS = {errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE, errno.EAGAIN, errno.ENETRESET}
_NEVER = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
sleep: Callable[[float], None] = time.sleep


def transient_kind(exc: BaseException) -> str | None:
    """What makes `exc` worth another try (an errno's name, the marker in its text), or None."""
    if not isinstance(exc, OSError) or isinstance(exc, _NEVER):
        return None
    if exc.errno in _ERRNOS:
        return errno.errorcode[exc.errno]
    found = _MARKERS.search(str(exc))
    return found.group(0) if found else None


def retried(call: Callable[[], T], what: str, attempts: int = ATTEMPTS) -> T:
    """`call()`, tried again after a transient error (`transient_kind`) up to `attempts` times in all.
    `what` names the operation in the retry lines (a key or a path under the root: never a credential)."""
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except OSError as exc:
            kind = transient_kind(exc)
            if kind is None or attempt == attempts:
                raise
            wait = FIRST_S * FACTOR ** (attempt - 1)
            print(f"storage: {what} failed ({kind}), attempt {attempt} of {attempts}; trying again in {wait:g} s",
                  file=sys.stderr, flush=True)
            sleep(wait)
    raise AssertionError("unreachable: the last attempt returns or raises")


class RetryingFs:
    """A `pyarrow.fs` filesystem whose single calls (file info, listings, deletes, folders) are `retried`;
    streams are opened on `raw`, and their callers retry the whole transfer (a stream cut midway cannot
    go on where it stopped)."""

    _SINGLE = frozenset({"get_file_info", "delete_file", "delete_dir", "delete_dir_contents", "create_dir", "move"})

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.raw, name)
        if name not in self._SINGLE:
            return value

        def call(*args, **kwargs):
            return retried(lambda: value(*args, **kwargs), f"{name} {_subject(args)}")

        return call


def _subject(args: tuple) -> str:
    first = args[0] if args else ""
    return str(getattr(first, "base_dir", first))  # a FileSelector names its folder
