"""Names a storage listing returned, checked before anything is deleted or downloaded.

A listing is hostile input: whoever can write the bucket can put a key `drafter/../../x` there (the
HTTP client collapses the `..` when the key is used again, so a delete of it deletes `x` elsewhere in
the bucket, or in another bucket), and on a local folder (`file://` or a path) a symlink in it leads
anywhere. A listed name is used only if its parts are plain (no `..`, `.`, empty or absolute part, no
backslash, no NUL) and, on a local filesystem, it resolves inside the folder listed.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path


def stays_inside(rel: str, folder: Path | None = None) -> bool:
    """Whether `rel` (a name relative to `folder`, as a listing returned it) names something inside it.
    `folder`: the folder on a local filesystem (its symlinks are resolved); None for an object store."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\\" in rel or "\x00" in rel or any(p in ("", ".", "..") for p in parts):
        return False
    return folder is None or (Path(folder) / rel).resolve().is_relative_to(Path(folder).resolve())


def inside(names: Iterable[str], folder: Path | None, where: str) -> list[str]:
    """The `names` that stay inside (`stays_inside`); the others are skipped with one warning naming
    them and `where` (the folder, relative to the storage root: never a URI that could carry a secret)."""
    names = list(names)
    kept = [n for n in names if stays_inside(n, folder)]
    if skipped := [n for n in names if n not in kept]:
        shown = ", ".join(repr(n) for n in skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        warnings.warn(f"skipping {len(skipped)} listed name(s) under {where!r} that leave the folder (a `..`, an "
                      f"absolute part or a symlink out of it, written there by hand): {shown}; remove them",
                      stacklevel=3)
    return kept
