"""Leaf types shared by the record readers and the chat-mask code (no imports from the rest of app/)."""
from __future__ import annotations


class MalformedRecord(Exception):
    """A record that cannot be turned into tokens; the reader names file and line."""
