"""`UriStorage`: a checkpoint root that `pyarrow.fs` opens (s3://, gs://, file://, ...), where entries
are published by a marker written last (the protocol: `publish.py`), and files are streamed in
CHUNK pieces both ways: a multi-GB checkpoint file never sits in memory whole. Transient errors (a 5xx,
SlowDown or throttling, a cut or timed-out connection) are retried by the S3 and GCS clients themselves,
request by request, as `with_retries` sets them up.
"""
from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from app.storage import fence
from app.storage.local_cache import cache_root, clean_stale_once, owned_tmp
from app.storage.names import inside, stays_inside
from app.storage.publish import MARKER, VERSION, Entry, Storage, marker_token, version_name

CHUNK = 8 << 20  # bytes a URI upload or download holds at once: checkpoints are multi-GB files
S3_ATTEMPTS = 5  # tries of one S3 request (the SDK's standard mode: backoff with jitter; 4 retries span ~10 s)
GCS_RETRY_S = 20  # how long the GCS client retries one request
SINGLE_PUT_MAX = 5 << 30  # S3's limit on one PUT: an export file above it is streamed in parts, unconditionally


class UriStorage(Storage):
    """A `pyarrow.fs` URI (s3://, gs://, file://, ...): entries published by a marker written last."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/") if "?" not in root else root
        self.fs, base = filesystem(root)
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

    def _local(self, rel: str) -> Path | None:
        """`<root>/<rel>` as a local folder when the filesystem is local (`file://`: its symlinks are
        real and pyarrow's listing walks through them), else None."""
        return Path(self._path(rel)) if self.fs.type_name == "local" else None

    # ---- files -------------------------------------------------------------------------------

    def write_file(self, rel: str, data: bytes) -> str:
        fence.guard(self, rel)  # a run that lost the folder writes no summary or report into it
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
        file never sits in memory whole. One object, visible once the stream closes. Fenced (`guard`):
        a multi-GB checkpoint's upload is checked again before each of its files."""
        fence.guard(self, rel)
        self._parent(rel)

        with open(local, "rb") as src, self.fs.open_output_stream(self._path(rel)) as out:
            copy_stream(src, out)  # each part's PUT retried by the client
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
        names = [i.path[len(base):].removeprefix("/") for i in infos if i.type == FileType.File]
        return sorted(inside(names, self._local(rel), rel))  # a listed `../x` would delete elsewhere

    # ---- entries -----------------------------------------------------------------------------

    def stage(self, name: str) -> Path:
        clean_stale_once()  # a SIGKILLed stager's folder of an earlier process: gone before this one adds its own
        return owned_tmp(f"stage-{name}-", cache_root())

    def publish(self, staged: Path, name: str) -> str:
        """Upload under a fresh version, then commit: the marker, `v-<nonce> <token>`. Fenced before the
        upload, before each file (`upload_file`), before the commit, and before each version the sweep
        deletes; the commit itself is conditional where the store has conditional writes (S3, GCS): a
        marker another writer replaced since it was read is never overwritten."""
        version = f"v-{uuid.uuid4().hex[:12]}"
        try:
            token = fence.check(self)  # a run that lost the lease (its driver stopped) must not publish any more
            for file in sorted(p for p in staged.rglob("*") if p.is_file()):
                self.upload_file(f"{name}/{version}/{file.relative_to(staged).as_posix()}", file)
            self._commit(name, f"{version} {token}".encode(), token)  # the commit point
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        self._sweep_versions(name, keep=version)
        return self.uri(f"{name}/{version}")

    def _commit(self, name: str, marker: bytes, token: int) -> None:
        """Write `name`'s marker after one more fence check, unless the marker there now was written under a
        newer token (the new holder's entry of that name)."""
        rel = f"{name}/{MARKER}"
        fence.check(self)
        store = self._conditional()
        if store is None:
            if marker_token(self.read_file(rel)) > token:
                raise self._newer(name, token)
            self.write_file(rel, marker)
            return
        found = store.read(rel)
        if found is not None and marker_token(found.data) > token:
            raise self._newer(name, token)
        written = store.create(rel, marker) if found is None else store.replace(rel, marker, found.etag)
        if written is None:  # replaced since it was read: whoever did is the newer writer
            raise self._newer(name, token)

    def _newer(self, name: str, token: int) -> fence.FencedOut:
        return fence.FencedOut(f"{self.location(name)} was published under a newer fencing token than this run's "
                               f"({token}) or by another writer meanwhile: another run holds the folder; this run stops")

    def _sweep_versions(self, name: str, keep: str) -> None:
        """Drop versions of `name` other than the published one (a rewrite's old data, crashed uploads),
        never the one the marker names now (another writer's commit since ours); fenced before each delete."""
        versions = self._versions(name)  # listed before the checks below: none is a later holder's upload
        live = version_name(self.read_file(f"{name}/{MARKER}"))
        for version in versions:
            if version not in (keep, live):
                fence.check(self)
                self.fs.delete_dir(self._path(f"{name}/{version}"))

    def entries(self, prefix: str) -> list[Entry]:
        from pyarrow.fs import FileSelector, FileType

        found = []
        names = [i.base_name for i in self.fs.get_file_info(FileSelector(self.base, allow_not_found=True))
                 if i.type == FileType.Directory and i.base_name.startswith(prefix)]
        for name in inside(names, self._local(""), "."):  # a planted link out is never read nor pruned
            marker = self.read_file(f"{name}/{MARKER}")
            version = version_name(marker)
            if version:  # unmarked: still being written, or half deleted; or not a version name at all
                found.append(Entry(name, self.uri(f"{name}/{version}"), marker_token(marker)))
        return found

    def delete(self, name: str) -> None:
        """Fenced: `FencedOut` once another run holds the folder; an entry of a newer token is left alone.
        On S3/GCS nothing it removes is the new holder's (`_delete_conditional`); elsewhere: check, delete."""
        from pyarrow.fs import FileType

        if not stays_inside(name, self._local("")):
            raise ValueError(f"refusing to delete entry {name!r}: it leaves the checkpoint root")
        if (store := self._conditional()) is not None:
            return self._delete_conditional(store, name)
        token = fence.check(self)
        if marker_token(self.read_file(f"{name}/{MARKER}")) > token:
            return
        marker = self._path(f"{name}/{MARKER}")
        if self.fs.get_file_info(marker).type == FileType.File:
            self.fs.delete_file(marker)  # unpublish first
        if self.fs.get_file_info(self._path(name)).type == FileType.Directory:
            self.fs.delete_dir(self._path(name))

    def _delete_conditional(self, store, name: str) -> None:
        """What is read before a fence check that passes predates any takeover (a new holder writes only
        after raising the counter): the marker goes only if still the version read (a conditional delete),
        then the versions listed; what the new holder uploads or commits later is never touched."""
        versions = self._versions(name)
        found = store.read(f"{name}/{MARKER}")
        token = fence.check(self)
        if found is None or marker_token(found.data) > token:
            return  # unpublished meanwhile, or the new holder's entry
        if not store.remove(f"{name}/{MARKER}", found.etag) and store.read(f"{name}/{MARKER}") is not None:
            return  # rewritten since it was read: the new holder's entry now (gone: our own retried delete)
        for version in versions:
            self.fs.delete_dir(self._path(f"{name}/{version}"))

    def _versions(self, name: str) -> list[str]:
        from pyarrow.fs import FileSelector, FileType

        infos = self.fs.get_file_info(FileSelector(self._path(name), allow_not_found=True))
        found = [i.base_name for i in infos if i.type == FileType.Directory and VERSION.fullmatch(i.base_name)]
        return inside(found, self._local(name), name)

    def _conditional(self):
        """S3's or GCS's conditional writes for this root (app/storage/conditional.py, made once), or None."""
        from app.storage.conditional import conditional_store

        if not hasattr(self, "_store"):
            self._store = conditional_store(self.root) if self.fs.type_name in ("s3", "gcs") else None
        return self._store

    # ---- the export, rewritten in place ----------------------------------------------------------

    def _replace_file(self, rel: str, local: Path) -> None:
        """One file of `upload_dir`. On S3/GCS one PUT that lands only if the file is still the version read
        before the fence check (none: only if still none), so a run paused after its check never writes
        over the new holder's file. A file over SINGLE_PUT_MAX is streamed: checked, then written."""
        store = self._conditional()
        if store is None or Path(local).stat().st_size > SINGLE_PUT_MAX:
            return super()._replace_file(rel, local)
        for _ in range(3):  # a failed condition and a check that still passes: our own retried PUT landed first
            seen = store.version(rel)
            fence.guard(self, rel)
            if store.put_file(rel, local, seen) is not None:
                return
        raise self._newer(rel, fence.held(self.root))

    def _drop_file(self, rel: str) -> None:
        """A file `upload_dir` removes: on S3/GCS only the version read before the fence check."""
        store = self._conditional()
        if store is None:
            return super()._drop_file(rel)
        for _ in range(3):  # as in `_replace_file`: the next check tells a takeover from a retry's echo
            seen = store.version(rel)
            fence.check(self)
            if seen is None or store.remove(rel, seen):
                return
        raise self._newer(rel, fence.held(self.root))


def download(fs, path: str, dest: Path) -> None:
    """One object to a local file, in CHUNK pieces (never the whole object in memory)."""
    with fs.open_input_stream(path) as src, open(dest, "wb") as out:
        copy_stream(src, out)


def filesystem(uri: str):
    """(filesystem, base path) of a URI, as `pyarrow.fs` opens it, with its client's retries set (`with_retries`)."""
    fs, base = _from_uri(uri)
    return with_retries(fs), base


def with_retries(fs):
    """`fs` with its client's own retry of transient errors (a 5xx, SlowDown, throttling, a cut or timed-out
    connection) set: S3's standard retry mode, S3_ATTEMPTS tries of each request with backoff; GCS's retry for
    GCS_RETRY_S. Anything else (a missing object, a refused permission) is raised at once. `from_uri` takes no
    retry setting, so the filesystem is opened again with the options it resolved. Other filesystems (local
    disk) are returned as they are."""
    from datetime import timedelta

    from pyarrow.fs import AwsStandardS3RetryStrategy, GcsFileSystem, S3FileSystem

    if isinstance(fs, S3FileSystem):
        options = fs.__reduce__()[1][0]
        return S3FileSystem(**options, retry_strategy=AwsStandardS3RetryStrategy(max_attempts=S3_ATTEMPTS))
    if isinstance(fs, GcsFileSystem):
        return GcsFileSystem(**{**fs.__reduce__()[1][0], "retry_time_limit": timedelta(seconds=GCS_RETRY_S)})
    return fs


def _from_uri(uri: str):
    from pyarrow.fs import FileSystem

    return FileSystem.from_uri(uri)


def copy_stream(src, out) -> None:
    """`src` to `out` one CHUNK at a time; the chunk is dropped before the next is read, so a copy
    holds one chunk, not two."""
    while True:
        chunk = src.read(CHUNK)
        if not chunk:
            return
        out.write(chunk)
        del chunk
