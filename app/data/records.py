"""The data's error types, a leaf shared by the readers (shards.py), the record formats (formats.py) and
the chat-mask code (nothing from the rest of app/ but the error base)."""
from __future__ import annotations

from app.config.errors import UserError


class MalformedRecord(Exception):
    """A record that cannot be turned into tokens; the reader names file and line."""

    reason = "malformed"  # its drop reason under data.on_error=skip (FileSummary.dropped)


class OutOfVocab(MalformedRecord):
    """A pre-tokenized record holding an id the target has no embedding for: its forward would raise
    on every target (a poison job), so it is refused before any actor starts."""

    reason = "out_of_vocab"


class DataError(UserError):
    """A mistake in the data (a malformed record under data.on_error=raise, a missing or unknown
    file, bad eval prompts): one line naming the file and line."""

    kind = "data"
