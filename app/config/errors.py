"""Errors a user causes before any actor starts: each is one line, printed as `<kind> error: ...`,
and the entry points exit 2 with it. A leaf module: it imports nothing from app/."""
from __future__ import annotations


class UserError(ValueError):
    """A user mistake found before the run starts; the message is one line that names the fix."""

    kind = "user"


class ConfigError(UserError):
    """A mistake in the config: the message names the key, the value and the fix."""

    kind = "config"
