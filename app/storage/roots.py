"""What a checkpoint root is: a plain path (a local folder) or a URI (`scheme://...`, opened by
`pyarrow.fs`); the storage over it, its name, its local folders, and its credentials, hidden from
every printed location.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlsplit

from app.storage.local_cache import cache_root
from app.storage.publish import LocalStorage, Storage
from app.storage.uri_storage import UriStorage


def is_uri(root: str | Path) -> bool:
    """True for `scheme://...` roots (object stores, `file://`); False for plain local paths."""
    return "://" in str(root)


# Credentials a URI can carry: userinfo (`s3://KEY:SECRET@bucket`, a secret with `/` included) and
# pyarrow's secret query options (`?access_key=..&secret_key=..&session_token=..`). The userinfo is hidden
# up to the host, i.e. to the last `@` of the URI: a password may hold `@` and `/` (`s3://K:p@s/s@bucket`
# showed `s/s@bucket` when the first `@` ended it), so a later `@` in the path is hidden too, never shown.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][\w+.-]*://)(?:[^\s'\"@/?#]*|[^\s'\"@/?#]*:[^\s'\"@]*)@"
                       r"(?:[^\s'\"]*@)?")
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


def root_problem(root: str | Path) -> str | None:
    """Why `root` cannot hold a run, in a few words, or None when it can: a scheme `pyarrow.fs` does not
    know, a store that does not answer, a bucket that does not exist (a run never creates one), a local
    folder that cannot be made. Asked before anything else touches the root."""
    if not is_uri(root):
        try:
            Path(root).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return f"the folder cannot be created ({e.strerror or type(e).__name__})"
        return None if os.access(root, os.W_OK | os.X_OK) else "the folder is not writable by this user"
    from pyarrow.fs import FileType

    try:
        store = UriStorage(str(root))
        if store.fs.type_name in ("s3", "gcs"):  # object stores: the bucket must be there; its prefix need not
            bucket = store.base.split("/", 1)[0]
            if store.fs.get_file_info(bucket).type == FileType.NotFound:
                return f"bucket {bucket!r} does not exist (a run never creates one: create it, or fix the name)"
        else:
            store.fs.get_file_info(store.base)
    except (OSError, ValueError) as e:  # pyarrow: ArrowInvalid (a ValueError) for a bad URI, OSError for a store
        text = str(e).strip()
        return (text.splitlines()[0] if text else type(e).__name__)[:300]
    return None


def open_storage(root: str | Path) -> Storage:
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
