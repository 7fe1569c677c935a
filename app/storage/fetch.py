"""A published folder or file brought onto this node: `fetch_dir` downloads a URI folder into this
user's bounded download cache (`local_cache.py`) and reuses the copy while it is current; `read_text`
reads one file of an entry without fetching the rest. A local path is used where it is.

Whoever can write the bucket must not get to write the node: `fetch_dir` refuses object keys with `..`,
`.`, empty or absolute parts and checks every destination stays inside the download folder.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from app.storage import local_cache, pins
from app.storage.names import stays_inside
from app.storage.roots import is_uri, redact
from app.storage.uri_storage import download, filesystem


def safe_destination(folder: Path, key: str, base: str) -> Path:
    """Where object `key` (listed under `base`) goes inside `folder`; `ValueError` for a key that would
    land anywhere else (`..`, `.`, empty or absolute parts, or a resolved path outside `folder`)."""
    prefix = base.rstrip("/") + "/"
    rel = key[len(prefix):] if key.startswith(prefix) else None
    parts = rel.split("/") if rel else []
    if not parts or rel.startswith("/") or any(p in ("", ".", "..") or "\\" in p or "\x00" in p for p in parts):
        raise ValueError(f"refusing to download object {key!r}: its key leaves {base!r} "
                         "(someone wrote it to the bucket by hand; delete it)")
    dest = folder.joinpath(*parts)
    if not dest.resolve().is_relative_to(folder.resolve()):
        raise ValueError(f"refusing to download object {key!r}: it would be written outside {folder}")
    return dest


def check_source(fs, path: str, base: str, location: str | Path) -> None:
    """On a local filesystem (`file://`) the listing walks through symlinks: a listed file that
    resolves outside `base` is refused (`ValueError`), or any file the process can read would be copied."""
    rel = path[len(base.rstrip("/")):].removeprefix("/")
    if fs.type_name == "local" and not stays_inside(rel, Path(base)):
        raise ValueError(f"refusing to download {rel!r} of {redact(location)}: it is a symlink out of the folder "
                         "(someone planted it; delete it)")


def fetch_dir(location: str | Path, cache: bool = True) -> Path:
    """A local folder with the files at `location` (a path: itself; a URI: a download, local_cache.py).

    `cache`: published checkpoint versions never change (a rewrite gets a new version), so a download
    is reused as it is. `cache=False`, for folders rewritten in place (the export): the copy is reused
    while the remote listing (every key, size and mtime) is what it was downloaded from, else replaced.
    Either way one copy per location, and per run root only the newest checkpoint versions stay
    (`KEEP_VERSIONS`): an earlier layout copied the export on every load and kept every version.
    Several processes on one node may fetch at once: each downloads into its own folder and installs it
    in one rename; readers see a whole copy, the old or the new. The copy handed out is pinned for this
    process (`pins.py`) until `release(path)` or the process ends: no eviction removes it meanwhile."""
    if not is_uri(location):
        return Path(location)
    from pyarrow.fs import FileSelector, FileType

    local_cache.clean_stale_once()
    entry, family, keep = local_cache.download_entry(str(location))
    if cache and (entry / "files").is_dir() and pins.pin(entry):
        return local_cache.use(entry)
    fs, base = filesystem(str(location))  # transient errors retried by the client (`with_retries`)
    infos = [i for i in fs.get_file_info(FileSelector(base, recursive=True)) if i.type == FileType.File]
    manifest = sorted([i.path, i.size, i.mtime_ns] for i in infos)
    if (entry / "files").is_dir() and local_cache.read_manifest(entry) == manifest and pins.pin(entry):
        return local_cache.use(entry)
    tmp = local_cache.owned_tmp(".fetch-", entry.parent)
    held = pins.hold(tmp)  # pinned before it is installed: no eviction between the install and the use
    try:
        (tmp / "files").mkdir()
        for info in infos:
            check_source(fs, info.path, base, location)
            dest = safe_destination(tmp / "files", info.path, base)
            dest.parent.mkdir(parents=True, exist_ok=True)
            download(fs, info.path, dest)
        (tmp / "manifest.json").write_text(json.dumps(manifest))
        (tmp / "location").write_text(str(location))  # whose run it is (`forget_downloads`)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if held is not None:
            os.close(held)
        raise
    local_cache.install(tmp, entry)
    if held is not None:
        pins.keep(entry, held)
    if not pins.pin(entry) and not pins.pin(entry):  # another fetch's copy went in instead: pin that one
        raise OSError(f"the download of {redact(location)} was replaced while it was installed; load it again")
    local_cache.evict(entry, family, keep)
    return local_cache.use(entry)


def release(path: str | Path) -> None:
    """Unpin a copy `fetch_dir` returned (its `files` folder) once it is read: the bound may evict it."""
    path = Path(path)
    if path.name == "files":
        pins.unpin(path.parent)


def read_text(location: str | Path, file: str) -> str:
    """One text file of an entry (e.g. a checkpoint's state.json) without fetching the rest."""
    if not is_uri(location):
        return (Path(location) / file).read_text()
    fs, base = filesystem(str(location))
    path = f"{base.rstrip('/')}/{file}"
    with fs.open_input_stream(path) as src:
        return src.read().decode()
