"""How the driver's Ray side reports what went wrong: the run-ending error and one-line error text."""
from __future__ import annotations


class RunFailed(RuntimeError):
    """The run cannot go on; the message is one line naming the actor, the error and the setting."""


def last_line(exc: BaseException) -> str:
    """The last non-empty line of an error: for a Ray task error that is the remote exception itself,
    below the traceback Ray prepends."""
    lines = [l for l in str(exc).splitlines() if l.strip()]
    return lines[-1][:300] if lines else type(exc).__name__
