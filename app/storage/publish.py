"""The storage interface over a checkpoint root, how an entry (a checkpoint, the export) is published
atomically, and the local folder's storage.

`open_storage(root)` (`roots.py`) gives a `Storage` over `checkpoint.dir`. A plain path (no `://`) is a local
folder and keeps the behaviour checkpoints always had: stage in `<root>/.dflash-tmp-<name>-<nonce>/` (`orphans.py`), rename
into place. Anything else (`s3://bucket/run?endpoint_override=host:port&scheme=http`, `gs://...`,
`file:///...`) goes through `pyarrow.fs.FileSystem.from_uri` (`UriStorage`, `uri_storage.py`). Object stores have no atomic rename, so
there an entry is published with a marker instead:

    <root>/<name>/v-<nonce>/...files...     written first, under a fresh prefix nobody reads yet
    <root>/<name>/COMMITTED                  written last; its content names the live v-<nonce>

A reader trusts only entries whose marker exists, and reads the version the marker names (the marker
also carries the fencing token the entry was published under: `v-<nonce> <token>`, fence.py). A single
object PUT is atomic, so the marker flips from the old version to the new in one step: a crash at any
point leaves either the old entry, the new one, or (for a first write) nothing readers would pick.
Deleting unpublishes first (marker, then data), so a half-deleted entry is never picked either. A
marker whose content is not a version name (`v-` and 12 hex digits) publishes nothing: whoever can
write the bucket must not get to point readers anywhere.

Fencing (fence.py): a publish checks the root's counter before it starts and again right before its
commit (the rename, the marker), and writes its token with the entry (a local entry under a lease holds
a hidden `.fence-token` file, which engines loading an export folder ignore); `delete` checks again and never
removes an entry written under a newer token than the deleting process's. `upload_dir` (the export)
checks before each file it writes or removes and before its last file; on S3/GCS its writes and removals,
and `delete`'s, are conditional on the version read before the check (uri_storage.py), so what a paused
run does after a takeover never replaces or removes what the new holder wrote.
"""
from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from app.storage import fence
from app.storage.local_cache import exchange
from app.storage.names import inside, stays_inside
from app.storage.orphans import aside_name, staging_name

MARKER = "COMMITTED"
VERSION = re.compile(r"v-[0-9a-f]{12}")  # what `publish` writes into a marker, and all a reader accepts


@dataclass(frozen=True)
class Entry:
    """A published entry: its name under the root and where its files are (a path or a URI)."""

    name: str
    location: str
    token: int = 0  # the fencing token it was published under (0: no lease, or written before tokens were)


class Storage(Protocol):
    """A checkpoint root. Entries (checkpoints, the export) are folders published atomically; single
    files (`rel`, a path under the root) are written, read and removed each in one step. `LocalStorage`
    and `UriStorage` implement it and inherit `scratch` and `upload_dir`, which it defines."""

    root: str

    def stage(self, name: str) -> Path:
        """A fresh, empty local folder to write entry `name` into before `publish`."""

    def publish(self, staged: Path, name: str) -> str:
        """Make the staged folder the entry `name`, atomically; returns its location. Consumes `staged`."""

    def entries(self, prefix: str) -> list[Entry]:
        """Published entries whose name starts with `prefix` (unordered)."""

    def delete(self, name: str) -> None:
        """Remove entry `name` (unpublished first, so a crash midway leaves nothing readers pick)."""

    def write_file(self, rel: str, data: bytes) -> str:
        """Write one file at `<root>/<rel>` (replacing it in one step); returns its location."""

    def read_file(self, rel: str) -> bytes | None:
        """The bytes of `<root>/<rel>`, or None when it does not exist."""

    def upload_file(self, rel: str, local: Path) -> str:
        """Copy one local file to `<root>/<rel>` (replacing it in one step, never whole in memory);
        returns its location."""

    def file_size(self, rel: str) -> int | None:
        """The size of `<root>/<rel>`, or None when it does not exist."""

    def download_file(self, rel: str, dest: Path) -> None:
        """`<root>/<rel>` into the local file `dest`, never whole in memory."""

    def files(self, rel: str) -> list[str]:
        """The files under `<root>/<rel>/`, as paths relative to it (none when it does not exist)."""

    def location(self, rel: str) -> str:
        """Where `<root>/<rel>` is, as a path or a URI other processes can open."""

    def remove_file(self, rel: str) -> None:
        """Delete `<root>/<rel>` if it exists."""

    @contextmanager
    def scratch(self, name: str) -> Iterator[Path]:
        """A staging folder (`stage`) for files of `name` that are uploaded, not published (the export),
        removed on exit; where a SIGKILL leaves it, the next process's start removes it (local_cache.py)."""
        tmp = self.stage(name)
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def upload_dir(self, local: Path, rel: str, last: str) -> str:
        """Copy a local folder to `<root>/<rel>/` in place (no versions: the layout stays what readers
        such as inference engines expect), `last` removed first and written last, so a reader that waits
        for it never sees a mix of old and new files. Returns the folder's location. `FencedOut` when
        another run holds the root's lease now (fence.py): checked before the first write and again before
        each file written or removed, so a run that lost the lease mid-export stops at its next file
        instead of finishing the folder over the new holder's. On S3/GCS each write and removal also
        lands only if the file is still the version read before that check (`_replace_file`, `_drop_file`
        in uri_storage.py): a run paused between its check and its write lands nothing over the new
        holder's files."""
        fence.check(self)
        self._drop_file(f"{rel}/{last}")
        files = {p.relative_to(local).as_posix(): p for p in sorted(Path(local).rglob("*"))
                 if p.is_file() and p.name != last}
        for name, file in files.items():
            self._replace_file(f"{rel}/{name}", file)
        # An older export's files the new one lacks go before `last` does: an engine loads every
        # *.safetensors in the folder, so an old run's shards beside a new single file would be read too.
        for stale in sorted(set(self.files(rel)) - set(files) - {last}):
            self._drop_file(f"{rel}/{stale}")
        self._replace_file(f"{rel}/{last}", Path(local) / last)
        return self.location(rel)

    def _replace_file(self, rel: str, local: Path) -> None:
        """One file of `upload_dir`, fenced (`upload_file` checks first)."""
        self.upload_file(rel, local)

    def _drop_file(self, rel: str) -> None:
        """A file `upload_dir` removes, fenced."""
        fence.check(self)
        self.remove_file(rel)


class LocalStorage(Storage):
    """A local folder: entries staged next to their final place and renamed into it."""

    def __init__(self, root: Path) -> None:
        self.path = Path(root)
        self.root = str(root)

    def stage(self, name: str) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / staging_name(name, uuid.uuid4().hex[:8])  # unique: two writers of one step never share it
        tmp.mkdir()
        return tmp

    def publish(self, staged: Path, name: str) -> str:
        token = fence.check(self)  # a run that lost the lease (its driver stopped) must not publish any more
        if token:  # readers rank entries by it (a root no lease touched: none, the folder as it always was)
            _write_synced(staged / fence.ENTRY_TOKEN, str(token).encode())
        final, old = self.path / name, self.path / aside_name(name)
        fence.check(self)  # again right before the commit: staging may have taken a while
        if self._token(name) > token:  # the new holder's own entry of that name: never replaced by this run
            raise fence.FencedOut(f"{self.location(name)} was published under a newer fencing token than this "
                                  f"run's ({token}): another run holds the folder; this run stops")
        if final.exists() and exchange(staged, final):  # one atomic swap: never a moment without `name`
            shutil.rmtree(staged, ignore_errors=True)  # now holds the previous copy
            return str(final)
        if final.exists():  # same entry written twice (e.g. a stop right after a periodic save)
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)  # set aside, not deleted, until the new one is in place
        staged.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        return str(final)

    def _token(self, name: str) -> int:
        path = self.path / name / fence.ENTRY_TOKEN
        return fence.entry_token(path.read_bytes()) if path.is_file() and not path.is_symlink() else 0

    def entries(self, prefix: str) -> list[Entry]:
        if not self.path.is_dir():
            return []
        names = [p.name for p in self.path.iterdir() if p.is_dir() and p.name.startswith(prefix)]
        return [Entry(n, str(self.path / n), self._token(n)) for n in inside(names, self.path, ".")]  # no link out

    def delete(self, name: str) -> None:
        """Fenced: `FencedOut` once another run holds the folder; an entry published under a newer token
        than this process's is left alone (its holder's): judged after it was moved aside, so one published
        between the check and the delete is put back, not deleted."""
        if not stays_inside(name, self.path):
            raise ValueError(f"refusing to delete entry {name!r}: it leaves the checkpoint root")
        token = fence.check(self)
        aside = self.path / staging_name(name, uuid.uuid4().hex[:8])
        try:  # moved out of sight first, then judged: a paused run never deletes what took the name meanwhile
            (self.path / name).rename(aside)
        except FileNotFoundError:
            return
        moved = aside / fence.ENTRY_TOKEN
        if fence.entry_token(moved.read_bytes() if moved.is_file() and not moved.is_symlink() else None) > token:
            try:  # the new holder's entry: back in place (unless it published the name again meanwhile)
                aside.rename(self.path / name)
                return
            except OSError:
                pass
        shutil.rmtree(aside, ignore_errors=True)

    def write_file(self, rel: str, data: bytes) -> str:
        fence.guard(self, rel)  # a run that lost the folder writes no summary or report into it
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
        fence.guard(self, rel)
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
        if not folder.is_dir():
            return []
        return sorted(inside([p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()], folder, rel))

    def location(self, rel: str) -> str:
        return str(self.path / rel)


def version_name(marker: bytes | None) -> str | None:
    """The version a marker names, or None when it names none (a `../..` in it would point readers anywhere)."""
    text = (marker or b"").decode("utf-8", "replace").strip()
    text = text.split(" ", 1)[0] if text.count(" ") == 1 else text  # `v-<nonce> <token>`; before tokens: `v-<nonce>`
    return text if VERSION.fullmatch(text) else None


def marker_token(marker: bytes | None) -> int:
    """The fencing token a marker names (`v-<nonce> <token>`); 0 for a marker written before tokens were."""
    parts = (marker or b"").decode("utf-8", "replace").split()
    return fence.entry_token(parts[1]) if len(parts) == 2 else 0


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
