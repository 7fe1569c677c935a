"""Where checkpoints, the export and the summary go: a local folder or a URI that `pyarrow.fs` opens.

`open_storage(root)` gives a `Storage` over `checkpoint.dir`. A plain path (no `://`) is a local
folder and keeps the behaviour checkpoints always had: stage in `<root>/.tmp-<name>-<nonce>/`, rename
into place. Anything else (`s3://bucket/run?endpoint_override=host:port&scheme=http`, `gs://...`,
`file:///...`) goes through `pyarrow.fs.FileSystem.from_uri`. Object stores have no atomic rename, so
there an entry is published with a marker instead:

    <root>/<name>/v-<nonce>/...files...     written first, under a fresh prefix nobody reads yet
    <root>/<name>/COMMITTED                  written last; its content names the live v-<nonce>

A reader trusts only entries whose marker exists, and reads the version the marker names. A single
object PUT is atomic, so the marker flips from the old version to the new in one step: a crash at any
point leaves either the old entry, the new one, or (for a first write) nothing readers would pick.
Deleting unpublishes first (marker, then data), so a half-deleted entry is never picked either.

Whoever can write the bucket must not get to write the node: `fetch_dir` refuses object keys with `..`,
`.`, empty or absolute parts and checks every destination stays inside the download folder, and a
marker whose content is not a version name (`v-` and 12 hex digits) publishes nothing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

# cache_root is re-exported: callers find this user's cache root where it always was
from app.local_cache import cache_root, exchange, owned_tmp  # noqa: F401

MARKER = "COMMITTED"
CHUNK = 8 << 20  # bytes a URI upload or download holds at once: checkpoints are multi-GB files
VERSION = re.compile(r"v-[0-9a-f]{12}")  # what `publish` writes into a marker, and all a reader accepts


def is_uri(root: str | Path) -> bool:
    """True for `scheme://...` roots (object stores, `file://`); False for plain local paths."""
    return "://" in str(root)


# Credentials a URI can carry: userinfo (`s3://KEY:SECRET@bucket`, a secret with `/` included) and
# pyarrow's secret query options (`?access_key=..&secret_key=..&session_token=..`).
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][\w+.-]*://)(?:[^\s'\"@/?#]*|[^\s'\"@/?#]*:[^\s'\"@]*)@")
_SECRET_QUERY = re.compile(r"(?P<name>[?&](?:access_key|[\w.-]*(?:secret|token|password|credential)[\w.-]*)=)[^&#\s'\"]*",
                           re.IGNORECASE)


def redact(text: str | Path) -> str:
    """`text` (a URI, a log line, an error message) with every URI credential replaced by `***`:
    the one function every printed or logged checkpoint location goes through."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}***@", str(text))
    return _SECRET_QUERY.sub(lambda m: f"{m['name']}***", text)


def has_credentials(text: str | Path) -> bool:
    """True when `text` holds a URI credential that `redact` would hide."""
    return redact(text) != str(text)


def open_storage(root: str | Path) -> "Storage":
    """The storage for a checkpoint root: `LocalStorage` for a path, `UriStorage` for a URI."""
    return UriStorage(str(root)) if is_uri(root) else LocalStorage(Path(root))


def root_name(root: str | Path) -> str:
    """The last path component of a root (a run's default name), for paths and URIs alike."""
    if is_uri(root):
        path = urlsplit(str(root)).path.rstrip("/")
        return path.rsplit("/", 1)[-1] or urlsplit(str(root)).hostname or "run"
    return Path(root).resolve().name


def local_path(root: str | Path) -> Path | None:
    """The root as a local folder, or None for a URI (a root with no folder of its own on this machine)."""
    return None if is_uri(root) else Path(root)


def local_cache_dir(root: str | Path) -> Path:
    """A local folder tied to a root: the root itself when local, else one in this user's cache root.

    For what must stay on a local disk even when checkpoints go to object storage (wandb files,
    fault markers, downloaded checkpoints, staged uploads)."""
    if (local := local_path(root)) is not None:
        return local
    import hashlib

    digest = hashlib.sha256(str(root).encode()).hexdigest()[:12]
    path = cache_root() / f"{root_name(root)}-{digest}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


@dataclass(frozen=True)
class Entry:
    """A published entry: its name under the root and where its files are (a path or a URI)."""

    name: str
    location: str


class Storage:
    """A checkpoint root. Entries (checkpoints, the export) are folders published atomically."""

    root: str

    def stage(self, name: str) -> Path:
        """A fresh, empty local folder to write entry `name` into before `publish`."""
        raise NotImplementedError

    def publish(self, staged: Path, name: str) -> str:
        """Make the staged folder the entry `name`, atomically; returns its location. Consumes `staged`."""
        raise NotImplementedError

    @contextmanager
    def scratch(self, name: str) -> Iterator[Path]:
        """A staging folder (`stage`) for files of `name` that are uploaded, not published (the export),
        removed on exit; where a SIGKILL leaves it, the next process's start removes it (app/local_cache.py)."""
        tmp = self.stage(name)
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def entries(self, prefix: str) -> list[Entry]:
        """Published entries whose name starts with `prefix` (unordered)."""
        raise NotImplementedError

    def delete(self, name: str) -> None:
        """Remove entry `name` (unpublished first, so a crash midway leaves nothing readers pick)."""
        raise NotImplementedError

    def write_file(self, rel: str, data: bytes) -> str:
        """Write one file at `<root>/<rel>` (replacing it in one step); returns its location."""
        raise NotImplementedError

    def read_file(self, rel: str) -> bytes | None:
        """The bytes of `<root>/<rel>`, or None when it does not exist."""
        raise NotImplementedError

    def upload_file(self, rel: str, local: Path) -> str:
        """Copy one local file to `<root>/<rel>` (replacing it in one step, never whole in memory);
        returns its location."""
        raise NotImplementedError

    def file_size(self, rel: str) -> int | None:
        """The size of `<root>/<rel>`, or None when it does not exist."""
        raise NotImplementedError

    def download_file(self, rel: str, dest: Path) -> None:
        """`<root>/<rel>` into the local file `dest`, never whole in memory."""
        raise NotImplementedError

    def upload_dir(self, local: Path, rel: str, last: str) -> str:
        """Copy a local folder to `<root>/<rel>/` in place (no versions: the layout stays what readers
        such as inference engines expect), `last` removed first and written last, so a reader that waits
        for it never sees a mix of old and new files. Returns the folder's location."""
        self.remove_file(f"{rel}/{last}")
        files = {p.relative_to(local).as_posix(): p for p in sorted(Path(local).rglob("*"))
                 if p.is_file() and p.name != last}
        for name, file in files.items():
            self.upload_file(f"{rel}/{name}", file)
        # An older export's files the new one lacks go before `last` does: an engine loads every
        # *.safetensors in the folder, so an old run's shards beside a new single file would be read too.
        for stale in sorted(set(self.files(rel)) - set(files) - {last}):
            self.remove_file(f"{rel}/{stale}")
        self.upload_file(f"{rel}/{last}", Path(local) / last)
        return self.location(rel)

    def files(self, rel: str) -> list[str]:
        """The files under `<root>/<rel>/`, as paths relative to it (none when it does not exist)."""
        raise NotImplementedError

    def location(self, rel: str) -> str:
        """Where `<root>/<rel>` is, as a path or a URI other processes can open."""
        raise NotImplementedError

    def remove_file(self, rel: str) -> None:
        """Delete `<root>/<rel>` if it exists."""
        raise NotImplementedError


class LocalStorage(Storage):
    """A local folder: entries staged next to their final place and renamed into it."""

    def __init__(self, root: Path) -> None:
        self.path = Path(root)
        self.root = str(root)

    def stage(self, name: str) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / f".tmp-{name}-{uuid.uuid4().hex[:8]}"  # unique: two writers of one step never share it
        tmp.mkdir()
        return tmp

    def publish(self, staged: Path, name: str) -> str:
        final, old = self.path / name, self.path / f".old-{name}"
        if final.exists() and exchange(staged, final):  # one atomic swap: never a moment without `name`
            shutil.rmtree(staged, ignore_errors=True)  # now holds the previous copy
            return str(final)
        if final.exists():  # same entry written twice (e.g. a stop right after a periodic save)
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)  # set aside, not deleted, until the new one is in place
        staged.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        return str(final)

    def entries(self, prefix: str) -> list[Entry]:
        if not self.path.is_dir():
            return []
        return [Entry(p.name, str(p)) for p in self.path.iterdir() if p.is_dir() and p.name.startswith(prefix)]

    def delete(self, name: str) -> None:
        shutil.rmtree(self.path / name, ignore_errors=True)

    def write_file(self, rel: str, data: bytes) -> str:
        path = self.path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        return str(path)

    def read_file(self, rel: str) -> bytes | None:
        path = self.path / rel
        return path.read_bytes() if path.is_file() else None

    def upload_file(self, rel: str, local: Path) -> str:
        path = self.path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        shutil.copyfile(local, tmp)
        tmp.replace(path)
        return str(path)

    def file_size(self, rel: str) -> int | None:
        path = self.path / rel
        return path.stat().st_size if path.is_file() else None

    def download_file(self, rel: str, dest: Path) -> None:
        shutil.copyfile(self.path / rel, dest)

    def remove_file(self, rel: str) -> None:
        (self.path / rel).unlink(missing_ok=True)

    def files(self, rel: str) -> list[str]:
        folder = self.path / rel
        return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) \
            if folder.is_dir() else []

    def location(self, rel: str) -> str:
        return str(self.path / rel)


class UriStorage(Storage):
    """A `pyarrow.fs` URI (s3://, gs://, file://, ...): entries published by a marker written last."""

    def __init__(self, root: str) -> None:
        from pyarrow.fs import FileSystem

        self.root = root.rstrip("/") if "?" not in root else root
        self.fs, base = FileSystem.from_uri(root)
        self.base = base.rstrip("/")

    # ---- locations ---------------------------------------------------------------------------

    def location(self, rel: str) -> str:
        return self.uri(rel)

    def uri(self, rel: str) -> str:
        """`<root>/<rel>` as a URI with the root's query (endpoint, scheme, ...) kept at the end."""
        parts = urlsplit(self.root)
        return urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/" + rel.strip("/")))

    def _path(self, rel: str) -> str:
        return f"{self.base}/{rel.strip('/')}" if rel else self.base

    # ---- files -------------------------------------------------------------------------------

    def write_file(self, rel: str, data: bytes) -> str:
        self._parent(rel)
        with self.fs.open_output_stream(self._path(rel)) as out:  # one PUT: readers see old or new
            out.write(data)
        return self.uri(rel)

    def _parent(self, rel: str) -> None:
        # A file:// root is a real filesystem: its folders must exist. Object stores have none (and a
        # create_dir there would add a marker object per folder).
        if self.fs.type_name == "local":
            self.fs.create_dir(self._path(rel).rsplit("/", 1)[0], recursive=True)

    def upload_file(self, rel: str, local: Path) -> str:
        """Streamed in CHUNK pieces (an S3 stream sends them as multipart parts): a multi-GB checkpoint
        file never sits in memory whole. One object, visible once the stream closes."""
        self._parent(rel)
        with open(local, "rb") as src, self.fs.open_output_stream(self._path(rel)) as out:
            copy_stream(src, out)
        return self.uri(rel)

    def read_file(self, rel: str) -> bytes | None:
        from pyarrow.fs import FileType

        if self.fs.get_file_info(self._path(rel)).type != FileType.File:
            return None
        with self.fs.open_input_stream(self._path(rel)) as src:
            return src.read()

    def file_size(self, rel: str) -> int | None:
        """The size of `<root>/<rel>`, or None when it does not exist."""
        from pyarrow.fs import FileType

        info = self.fs.get_file_info(self._path(rel))
        return info.size if info.type == FileType.File else None

    def download_file(self, rel: str, dest: Path) -> None:
        """`<root>/<rel>` into the local file `dest`, streamed in CHUNK pieces."""
        download(self.fs, self._path(rel), Path(dest))

    def remove_file(self, rel: str) -> None:
        from pyarrow.fs import FileType

        if self.fs.get_file_info(self._path(rel)).type == FileType.File:
            self.fs.delete_file(self._path(rel))

    def files(self, rel: str) -> list[str]:
        from pyarrow.fs import FileSelector, FileType

        base = self._path(rel)
        infos = self.fs.get_file_info(FileSelector(base, recursive=True, allow_not_found=True))
        return sorted(i.path[len(base):].lstrip("/") for i in infos if i.type == FileType.File)

    # ---- entries -----------------------------------------------------------------------------

    def stage(self, name: str) -> Path:
        from app.local_cache import clean_stale_once

        clean_stale_once()  # a SIGKILLed stager's folder of an earlier process: gone before this one adds its own
        return owned_tmp(f"stage-{name}-", cache_root())

    def publish(self, staged: Path, name: str) -> str:
        version = f"v-{uuid.uuid4().hex[:12]}"
        try:
            for file in sorted(p for p in staged.rglob("*") if p.is_file()):
                self.upload_file(f"{name}/{version}/{file.relative_to(staged).as_posix()}", file)
            self.write_file(f"{name}/{MARKER}", version.encode())  # the commit point
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        self._sweep_versions(name, keep=version)
        return self.uri(f"{name}/{version}")

    def _sweep_versions(self, name: str, keep: str) -> None:
        """Drop versions of `name` other than the published one (a rewrite's old data, crashed uploads)."""
        from pyarrow.fs import FileSelector, FileType

        infos = self.fs.get_file_info(FileSelector(self._path(name), allow_not_found=True))
        for info in infos:
            if info.type == FileType.Directory and info.base_name.startswith("v-") and info.base_name != keep:
                self.fs.delete_dir(info.path)

    def entries(self, prefix: str) -> list[Entry]:
        from pyarrow.fs import FileSelector, FileType

        found = []
        for info in self.fs.get_file_info(FileSelector(self.base, allow_not_found=True)):
            if info.type != FileType.Directory or not info.base_name.startswith(prefix):
                continue
            version = _version_name(self.read_file(f"{info.base_name}/{MARKER}"))
            if version:  # unmarked: still being written, or half deleted; or not a version name at all
                found.append(Entry(info.base_name, self.uri(f"{info.base_name}/{version}")))
        return found

    def delete(self, name: str) -> None:
        from pyarrow.fs import FileType

        marker = self._path(f"{name}/{MARKER}")
        if self.fs.get_file_info(marker).type == FileType.File:
            self.fs.delete_file(marker)  # unpublish first
        if self.fs.get_file_info(self._path(name)).type == FileType.Directory:
            self.fs.delete_dir(self._path(name))


def _version_name(marker: bytes | None) -> str | None:
    """The version a marker names, or None when it names none (a `../..` in it would point readers anywhere)."""
    text = (marker or b"").decode("utf-8", "replace").strip()
    return text if VERSION.fullmatch(text) else None


def safe_destination(folder: Path, key: str, base: str) -> Path:
    """Where object `key` (listed under `base`) goes inside `folder`; `ValueError` for a key that would
    land anywhere else (`..`, `.`, empty or absolute parts, or a resolved path outside `folder`)."""
    prefix = base.rstrip("/") + "/"
    rel = key[len(prefix):] if key.startswith(prefix) else None
    parts = rel.split("/") if rel else []
    if not parts or rel.startswith("/") or any(p in ("", ".", "..") or "\\" in p for p in parts):
        raise ValueError(f"refusing to download object {key!r}: its key leaves {base!r} "
                         "(someone wrote it to the bucket by hand; delete it)")
    dest = folder.joinpath(*parts)
    if not dest.resolve().is_relative_to(folder.resolve()):
        raise ValueError(f"refusing to download object {key!r}: it would be written outside {folder}")
    return dest


def fetch_dir(location: str | Path, cache: bool = True) -> Path:
    """A local folder with the files at `location` (a path: itself; a URI: a download, app/local_cache.py).

    `cache`: published checkpoint versions never change (a rewrite gets a new version), so a download
    is reused as it is. `cache=False`, for folders rewritten in place (the export): the copy is reused
    while the remote listing (every key, size and mtime) is what it was downloaded from, else replaced.
    Either way one copy per location, and per run root only the newest checkpoint versions stay
    (`KEEP_VERSIONS`): an earlier layout copied the export on every load and kept every version.
    Several processes on one node may fetch at once: each downloads into its own folder and installs it
    in one rename; readers see a whole copy, the old or the new."""
    if not is_uri(location):
        return Path(location)
    from pyarrow.fs import FileSelector, FileSystem, FileType

    from app import local_cache

    local_cache.clean_stale_once()
    entry, family, keep = local_cache.download_entry(str(location))
    if cache and (entry / "files").is_dir():
        return local_cache.use(entry)
    fs, base = FileSystem.from_uri(str(location))
    infos = [i for i in fs.get_file_info(FileSelector(base, recursive=True)) if i.type == FileType.File]
    manifest = sorted([i.path, i.size, i.mtime_ns] for i in infos)
    if (entry / "files").is_dir() and local_cache.read_manifest(entry) == manifest:
        return local_cache.use(entry)
    tmp = local_cache.owned_tmp(".fetch-", entry.parent)
    try:
        (tmp / "files").mkdir()
        for info in infos:
            dest = safe_destination(tmp / "files", info.path, base)
            dest.parent.mkdir(parents=True, exist_ok=True)
            download(fs, info.path, dest)
        (tmp / "manifest.json").write_text(json.dumps(manifest))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    local_cache.install(tmp, entry)
    local_cache.evict(entry, family, keep)
    return local_cache.use(entry)


def download(fs, path: str, dest: Path) -> None:
    """One object to a local file, in CHUNK pieces (never the whole object in memory)."""
    with fs.open_input_stream(path) as src, open(dest, "wb") as out:
        copy_stream(src, out)


def copy_stream(src, out) -> None:
    """`src` to `out` one CHUNK at a time; the chunk is dropped before the next is read, so a copy
    holds one chunk, not two."""
    while True:
        chunk = src.read(CHUNK)
        if not chunk:
            return
        out.write(chunk)
        del chunk


def read_text(location: str | Path, file: str) -> str:
    """One text file of an entry (e.g. a checkpoint's state.json) without fetching the rest."""
    if not is_uri(location):
        return (Path(location) / file).read_text()
    from pyarrow.fs import FileSystem

    fs, base = FileSystem.from_uri(str(location))
    with fs.open_input_stream(f"{base.rstrip('/')}/{file}") as src:
        return src.read().decode()
