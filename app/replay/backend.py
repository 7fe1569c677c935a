"""Where the store's files live: a local folder, or a `pyarrow.fs` URI (the checkpoint storage's schemes).

Both write an entry once: `create` is atomic and refuses a second writer of the same name (a local
folder writes a private temporary file and hard-links it into place, which fails when the name exists;
S3 with boto3 installed puts with `If-None-Match: *`; other URIs check first, then write one object,
which readers see whole or not at all). Reads never follow a planted symlink out of a local folder.
"""
from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

STALE_TMP_S = 3600  # a temporary file this old is a dead writer's leftover (a live one renames within seconds)
TMP_PREFIX = ".tmp-"


def open_backend(location: str):
    """`LocalFolder` for a path or a file:// URI, `UriFolder` for every other URI."""
    from urllib.parse import unquote, urlsplit

    from app.storage.roots import is_uri

    if not is_uri(location):
        return LocalFolder(Path(location))
    parts = urlsplit(location)
    if parts.scheme == "file":
        return LocalFolder(Path(unquote(parts.path)))
    return UriFolder(location)


class LocalFolder:
    """A replay store in a local folder (node-local NVMe, or a shared filesystem)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def read(self, rel: str) -> bytes | None:
        try:
            fd = os.open(self.root / rel, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError:  # ELOOP: a symlink planted under an entry's name
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def create(self, rel: str, data: bytes) -> bool:
        """Write `rel` whole, once: False when it already exists (another writer was first)."""
        final = self.root / rel
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.link(tmp, final)  # atomic, and never replaces: the second writer gets FileExistsError
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def remove(self, rel: str) -> None:
        (self.root / rel).unlink(missing_ok=True)

    def used_bytes(self) -> int:
        """Bytes of every file under the root (temporary ones too: they take the disk as well)."""
        total = 0
        for folder, _, names in os.walk(self.root):
            for n in names:
                try:
                    total += os.lstat(os.path.join(folder, n)).st_size
                except FileNotFoundError:  # renamed or removed meanwhile
                    pass
        return total

    def clean_stale(self, prefix: str, now: float | None = None) -> int:
        """Remove dead writers' temporary files under `prefix` (older than STALE_TMP_S); returns how many."""
        now, removed = time.time() if now is None else now, 0
        for folder, _, names in os.walk(self.root / prefix):
            for n in names:
                path = Path(folder) / n
                try:
                    if n.startswith(TMP_PREFIX) and now - path.lstat().st_mtime > STALE_TMP_S:
                        path.unlink()
                        removed += 1
                except FileNotFoundError:
                    pass
        return removed


class UriFolder:
    """A replay store under a `pyarrow.fs` URI (s3://, gs://, ...): one object per entry."""

    def __init__(self, root: str) -> None:
        from app.storage.conditional import conditional_store
        from app.storage.uri_storage import UriStorage

        self.store = UriStorage(root)  # the checkpoint storage's reader: listing names kept inside the root
        self.conditional = conditional_store(root)  # create-if-absent on S3 with boto3, else None

    def read(self, rel: str) -> bytes | None:
        return self.store.read_file(rel)

    def create(self, rel: str, data: bytes) -> bool:
        if self.conditional is not None:
            return self.conditional.create(rel, data) is not None
        if self.store.file_size(rel) is not None:  # no conditional put here: a racing writer may still win
            return False
        self.store._parent(rel)  # a real filesystem's folders (object stores have none)
        with self.store.fs.open_output_stream(self.store._path(rel)) as out:  # one PUT: whole or nothing
            out.write(data)
        return True

    def remove(self, rel: str) -> None:
        self.store.remove_file(rel)

    def used_bytes(self) -> int:
        from pyarrow.fs import FileSelector, FileType

        infos = self.store.fs.get_file_info(FileSelector(self.store.base, recursive=True, allow_not_found=True))
        return sum(i.size or 0 for i in infos if i.type == FileType.File)

    def clean_stale(self, prefix: str, now: float | None = None) -> int:
        return 0  # objects appear whole: there is no temporary object to clean
