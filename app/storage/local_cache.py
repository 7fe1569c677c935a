# Over 300 lines: one cache lifecycle (staging, start-up cleanup, install, pin-aware eviction) in one place.
"""This user's local disk for URI runs: the private cache root, staging that names its owner, stale
staging cleaned on start, and the bounded download cache.

A URI `checkpoint.dir` still needs local disk: each checkpoint is staged before its upload, and each
checkpoint version or export a process loads is downloaded first (`fetch.py` `fetch_dir`). Left
alone that disk only grows: a driver or rank killed with SIGKILL leaves its staging folder, every version
a node ever resumed from stays cached, and an export was copied anew on every load. Here:

- `cache_root()`: `<tmp>/dflash-<uid>/`, 0700, never a symlink or another user's folder;
- `owned_tmp`: staging and partial downloads are named `<kind><pid>@<host>~<namespace tag>-<random>`, so a
  later process can tell a dead owner's leftovers from a live one's (`clean_stale`, once per process:
  `clean_stale_once`); the pid is judged only in the owner's own boot and pid namespace (owner.py), and a
  folder of an owner this process cannot see goes only once untouched for FOREIGN_STALE_S;
- downloads live in `<cache_root>/downloads/<family>-<entry>/` (`files/`, `manifest.json`, `location`,
  `pin.lock`); an entry is installed whole by a rename (or an atomic exchange with the copy it replaces)
  and, per family (the versions of one checkpoint root, or one export folder), only the `keep` most
  recently used stay; over all families the node holds its byte bound, `checkpoint.download_cache_gb`
  (`bound_downloads`, least recently used first, at each install and at start); a run's own entries
  (those whose recorded location is an entry of its root, exactly: endpoint and query included) are
  removed when it ends (`forget_downloads`, from the lease's release); an entry no process used for
  `DOWNLOAD_STALE_S` (a finished run's elsewhere) is removed at the next start. None of these removes
  an entry a process pins (`pins.py`: a shared lock held while it reads, from the fetch on), nor does a
  re-download replace one in place: a pinned copy is set aside under a name of its family and goes once
  unpinned. An entry larger than the bound alone, or pinned ones, can hold the node above it.

Nothing here follows a symlink: a planted link is unlinked, never entered.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from app.storage import pins
from app.storage.owner import UNKNOWN, namespace_tag, pid_alive

KEEP_VERSIONS = 2  # checkpoint versions kept per run root: the one in use and the one replacing it
LEGACY_STALE_S = 6 * 3600  # staging named before owners were recorded: stale once this old
# Staging of an owner this process cannot see (another host, boot or pid namespace, or named before
# namespaces were): stale once untouched this long, far beyond any save's or download's time.
FOREIGN_STALE_S = 3 * 24 * 3600
# A download no process used for this long (a finished run's checkpoint versions and exports) is removed
# at the next start: each entry is marked when used, and a run resumes from its cache within days.
DOWNLOAD_STALE_S = 3 * 24 * 3600
# The node's bound in bytes over every run's downloads (each a checkpoint version or an export, GBs each),
# the default of `checkpoint.download_cache_gb` until a process sets its own (`set_download_bound`).
DOWNLOAD_CACHE_BYTES = 25 << 30
_bound = [DOWNLOAD_CACHE_BYTES]
STAGING_KINDS = ("stage-", ".fetch-", ".swap-")
DOWNLOADS = "downloads"
# ...-<pid>@<host>~<namespace tag>-<mkdtemp's random part> (no tag: named before tags were)
_TAG = re.compile(r"-(?P<pid>\d+)@(?P<host>[^~@/]+?)(?:~(?P<ns>[0-9a-f]{12}|x))?-[^-]+$")
_LEGACY_VERSION_CACHE = re.compile(r"v-[0-9a-f]{12}-[0-9a-f]{12}")  # the old layout: one folder per version
_VERSION_TAIL = re.compile(r"/(?P<name>[^/]+)/v-[0-9a-f]{12}$")
_VERSION = re.compile(r"v-[0-9a-f]{12}")
_DOWNLOAD_ENTRY = re.compile(r"[0-9a-f]{12}-[0-9a-f]{12}")  # <family>-<entry> digests: `download_entry`
_cleaned: set[str] = set()


def cache_root() -> Path:
    """`<tmp>/dflash-<uid>/`: this user's private (0700) folder for URI runs' caches and staging. A
    shared /tmp lets anyone create a predictable name first: a symlink there, or a folder of another
    owner, is refused (`RuntimeError`), never followed."""
    path = Path(tempfile.gettempdir()) / f"dflash-{os.getuid()}"
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise RuntimeError(f"{path} is not a folder of this user (a symlink, a file or another user's folder): "
                           "refusing to cache there; remove it or set TMPDIR to a private folder")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o700)  # ours but opened up: others could plant files in it
    return path


def owned_tmp(kind: str, parent: Path) -> Path:
    """A fresh folder `<parent>/<kind><pid>@<host>~<namespace tag>-XXXXXXXX` (0700): its name says who may
    still use it (the tag: this boot and pid namespace, owner.py, without which the pid means nothing)."""
    return Path(tempfile.mkdtemp(prefix=f"{kind}{os.getpid()}@{socket.gethostname()}~{namespace_tag()}-", dir=parent))


def owner_alive(name: str) -> bool | None:
    """Whether the process named in a staging folder's name still runs; None when this process cannot
    tell: the name names no owner (an older layout), or one it cannot see (another host, boot or pid
    namespace: a container's pid 1 is not ours, dead or alive), and the folder is judged by its age."""
    m = _TAG.search(name)
    if m is None or m["host"] != socket.gethostname() or m["ns"] in (None, UNKNOWN) or m["ns"] != namespace_tag():
        return None
    return pid_alive(int(m["pid"]))


def clean_stale(root: Path | None = None, now: float | None = None) -> list[str]:
    """Remove staging folders and partial downloads whose owner is gone (a SIGKILL mid-save leaves them),
    the old layout's per-version download copies, and downloads unused for `DOWNLOAD_STALE_S` (only
    names `download_entry` makes). Looks at the cache root and one level below (each run's cache
    folder, the downloads). Returns what it removed (names)."""
    root = cache_root() if root is None else root
    now = time.time() if now is None else now
    done: list[str] = []
    for folder in [root, *_subfolders(root)]:
        for entry in _scan(folder):
            if folder == root / DOWNLOADS and _unused_download(entry, now):
                if _drop(Path(entry.path)):  # unused for days, unless a process pins it still
                    done.append(entry.name)
                continue
            if not entry.name.startswith(STAGING_KINDS) and not (folder == root and _legacy_version_cache(entry)):
                continue
            if entry.is_symlink():  # planted: drop the link, never what it points to
                os.unlink(entry.path)
                done.append(entry.name)
                continue
            info = entry.stat(follow_symlinks=False)
            if info.st_uid != os.getuid():
                continue
            alive = owner_alive(entry.name) if entry.name.startswith(STAGING_KINDS) else False
            if alive is None:  # an owner it cannot see: no save or download stays untouched for that long
                alive = now - info.st_mtime < (FOREIGN_STALE_S if _TAG.search(entry.name) else LEGACY_STALE_S)
            if not alive:
                _remove(Path(entry.path))
                done.append(entry.name)
    return done + bound_downloads(root / DOWNLOADS, now)


def clean_stale_once() -> list[str]:
    """`clean_stale` the first time a process stages or downloads (its start, as far as disk goes)."""
    root = cache_root()
    if str(root) in _cleaned:
        return []
    _cleaned.add(str(root))
    return clean_stale(root)


def _subfolders(root: Path) -> list[Path]:
    return [Path(e.path) for e in _scan(root) if e.is_dir(follow_symlinks=False)
            and not e.name.startswith(STAGING_KINDS)]


def _scan(folder: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _legacy_version_cache(entry: os.DirEntry) -> bool:
    """A download of one checkpoint version in the old layout (`v-<hex>-<hex>/files/`), never reused now.
    A run's own cache folder holds the timeline, wandb files or the data cache, never only `files/`."""
    if not (_LEGACY_VERSION_CACHE.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)):
        return False
    return {e.name for e in _scan(Path(entry.path)) if not e.name.startswith(STAGING_KINDS)} <= {"files"}


def _unused_download(entry: os.DirEntry, now: float) -> bool:
    """A download entry of ours not used for DOWNLOAD_STALE_S."""
    return _our_download(entry) and now - entry.stat(follow_symlinks=False).st_mtime > DOWNLOAD_STALE_S


def _our_download(entry: os.DirEntry) -> bool:
    """A name `download_entry` makes, a real folder (a link is never entered), this user's."""
    return bool(_DOWNLOAD_ENTRY.fullmatch(entry.name)) and entry.is_dir(follow_symlinks=False) \
        and entry.stat(follow_symlinks=False).st_uid == os.getuid()


def set_download_bound(max_bytes: int) -> None:
    """This process holds the node's downloads to `max_bytes` (from `checkpoint.download_cache_gb`)."""
    _bound[0] = int(max_bytes)


def entry_bytes(entry: Path) -> int:
    """The bytes of an entry's files (their sizes: a sparse file counts whole, so the bound errs safe)."""
    total = 0
    for folder, _, files in os.walk(entry):  # os.walk never enters a linked folder
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                pass
    return total


def bound_downloads(folder: Path, now: float | None = None, max_bytes: int | None = None) -> list[str]:
    """The node's byte bound: this user's download entries in `folder`, least recently used first, are
    removed until the rest fit in `max_bytes` (default: this process's bound); a pinned entry is never
    removed (a live process reads it). Returns the names removed."""
    limit = _bound[0] if max_bytes is None else max_bytes
    found = sorted(((e.stat(follow_symlinks=False).st_mtime, Path(e.path)) for e in _scan(folder) if _our_download(e)))
    sizes = {path: entry_bytes(path) for _, path in found}
    total, removed = sum(sizes.values()), []
    for _, path in found:
        if total <= limit:
            break
        if _drop(path):
            total -= sizes[path]
            removed.append(path.name)
    return removed


def forget_downloads(root: str, cache: Path | None = None) -> list[str]:
    """A run's downloads on this node, removed when the run ends: the entries whose recorded location is
    one of `root`'s entries (`<root>/<name>` or `<root>/<name>/v-<hex>`, the same scheme, bucket, endpoint
    and query), never one a live process pins (this process's own pins on them are let go first: its run ends). A nested root's entries (`<root>/runs/a/...`) and the same
    path on another endpoint are another run's. Returns the names removed."""
    folder = (cache_root() if cache is None else cache) / DOWNLOADS
    removed = []
    for entry in _scan(folder):
        if not (_our_download(entry) and _of_root(_location(Path(entry.path)), root)):
            continue
        pins.unpin(Path(entry.path))  # the run ends in this process: what it still pins, it is done with
        if _drop(Path(entry.path)):
            removed.append(entry.name)
    return removed


def _location(entry: Path) -> str | None:
    try:
        return (entry / "location").read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _of_root(location: str | None, root: str) -> bool:
    if not location:
        return False
    loc, top = urlsplit(location), urlsplit(root)
    if (loc.scheme, loc.netloc, loc.query) != (top.scheme, top.netloc, top.query):
        return False
    rel = loc.path.rstrip("/").removeprefix(top.path.rstrip("/") + "/")
    parts = rel.split("/") if rel != loc.path.rstrip("/") else []
    return len(parts) == 1 and parts[0] not in ("", ".", "..") or \
        (len(parts) == 2 and parts[0] not in ("", ".", "..") and _VERSION.fullmatch(parts[1]) is not None)


def _drop(entry: Path) -> bool:
    """Out of readers' sight first (one rename), then deleted; never an entry a process pins. Whether it went."""
    with pins.claim(entry) as free:
        if not free:
            return False
        aside = owned_tmp(".swap-", entry.parent)
        try:
            entry.rename(aside / "old")
        except OSError:
            pass
    shutil.rmtree(aside, ignore_errors=True)
    return True


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)  # rmtree unlinks links inside, never follows them


# ---- the download cache ------------------------------------------------------------------------------

def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def download_entry(location: str) -> tuple[Path, str, int]:
    """(entry folder, family, how many entries of the family to keep) for a download of `location`.

    A checkpoint version (`<root>/<name>/v-<hex>`) belongs to the family of its root: a newer checkpoint
    replaces it. Anything else (an export folder, rewritten in place) is a family of one."""
    parts = urlsplit(location)
    m = _VERSION_TAIL.search(parts.path.rstrip("/"))
    if m is not None:
        family, keep = _digest(urlunsplit(parts._replace(path=parts.path[:m.start()]))), KEEP_VERSIONS
    else:
        family, keep = _digest(location), 1
    folder = cache_root() / DOWNLOADS
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder / f"{family}-{_digest(location)}", family, keep


def read_manifest(entry: Path) -> list | None:
    """What the cached copy was downloaded from (each file's key, size and mtime), or None."""
    try:
        return json.loads((entry / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def use(entry: Path) -> Path:
    """Mark a cached entry as just used (eviction keeps the most recently used); returns its files."""
    try:
        os.utime(entry)
    except FileNotFoundError:
        pass
    return entry / "files"


def install(tmp: Path, entry: Path) -> None:
    """Put a complete download `tmp` at `entry` in one step: a reader sees the old copy or the new one.
    Another process installing the same entry at once: either copy is complete, one of them stays. A
    previous copy some process pins is set aside under a fresh name of its family (`_retire`), not
    deleted: the bound removes it once unpinned."""
    if entry.exists():
        with pins.claim(entry) as free:
            if free and exchange(tmp, entry):
                shutil.rmtree(tmp, ignore_errors=True)  # now the previous copy
                return
        if not (free and _drop(entry)):
            _retire(entry)
    try:
        tmp.rename(entry)
    except OSError:  # another fetch installed it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)


def _retire(entry: Path) -> None:
    family = entry.name.split("-", 1)[0]
    try:
        entry.rename(entry.with_name(f"{family}-{os.urandom(6).hex()}"))
    except OSError:
        pass


def evict(entry: Path, family: str, keep: int) -> list[str]:
    """Drop the family's entries beyond the `keep` most recently used (`entry`, just installed, stays),
    none a process pins, then hold the node's byte bound (`bound_downloads`)."""
    others = [Path(e.path) for e in _scan(entry.parent) if e.name.startswith(f"{family}-")
              and e.is_dir(follow_symlinks=False) and e.path != str(entry)]
    others.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    removed = [old.name for old in others[max(0, keep - 1):] if _drop(old)]
    return removed + bound_downloads(entry.parent)


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported, and the
    caller falls back to set-aside-then-rename."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
