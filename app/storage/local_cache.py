"""This user's local disk for URI runs: the private cache root, staging that names its owner, stale
staging cleaned on start, and the bounded download cache.

A URI `checkpoint.dir` still needs local disk: each checkpoint is staged before its upload, and each
checkpoint version or export a process loads is downloaded first (`fetch.py` `fetch_dir`). Left
alone that disk only grows: a driver or rank killed with SIGKILL leaves its staging folder, every version
a node ever resumed from stays cached, and an export was copied anew on every load. Here:

- `cache_root()`: `<tmp>/dflash-<uid>/`, 0700, never a symlink or another user's folder;
- `owned_tmp`: staging and partial downloads are named `<kind><pid>@<host>-<random>`, so a later process
  can tell a dead owner's leftovers from a live one's (`clean_stale`, once per process: `clean_stale_once`);
- downloads live in `<cache_root>/downloads/<family>-<entry>/` (`files/` and `manifest.json`); an entry
  is installed whole by a rename (or an atomic exchange with the copy it replaces) and, per family (the
  versions of one checkpoint root, or one export folder), only the `keep` most recently used stay;
  over all families the node keeps `KEEP_DOWNLOADS` entries (`bound_downloads`, at each install and at
  start; one used within `BUSY_S` stays, a live process may read it); a run's own entries are removed
  when it ends (`forget_downloads`, from the lease's release); an entry no process used for
  `DOWNLOAD_STALE_S` (a finished run's elsewhere) is removed at the next start.

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

KEEP_VERSIONS = 2  # checkpoint versions kept per run root: the one in use and the one replacing it
LEGACY_STALE_S = 6 * 3600  # staging named before owners were recorded: stale once this old
# A download no process used for this long (a finished run's checkpoint versions and exports) is removed
# at the next start: each entry is marked when used, and a run resumes from its cache within days.
DOWNLOAD_STALE_S = 3 * 24 * 3600
# The node's bound over every run's downloads (each a checkpoint version or an export, GBs each): the
# entries of two runs resuming here at once (a version in use, its replacement, an export each) fit.
KEEP_DOWNLOADS = 6
BUSY_S = 600  # an entry used this recently may be in a live process's hands: never evicted for the bound
STAGING_KINDS = ("stage-", ".fetch-", ".swap-")
DOWNLOADS = "downloads"
_TAG = re.compile(r"-(?P<pid>\d+)@(?P<host>.+)-[^-]+$")  # ...-<pid>@<host>-<mkdtemp's random part>
_LEGACY_VERSION_CACHE = re.compile(r"v-[0-9a-f]{12}-[0-9a-f]{12}")  # the old layout: one folder per version
_VERSION_TAIL = re.compile(r"/(?P<name>[^/]+)/v-[0-9a-f]{12}$")
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
    """A fresh folder `<parent>/<kind><pid>@<host>-XXXXXXXX` (0700): its name says who may still use it."""
    return Path(tempfile.mkdtemp(prefix=f"{kind}{os.getpid()}@{socket.gethostname()}-", dir=parent))


def owner_alive(name: str) -> bool | None:
    """Whether the process named in a staging folder's name still runs; None when the name names none
    (an older layout). Another host's staging (a shared TMPDIR) is taken as alive: its pid means nothing here."""
    m = _TAG.search(name)
    if m is None:
        return None
    if m["host"] != socket.gethostname():
        return True
    return pid_alive(int(m["pid"]))


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (another user's live process counts: it is not ours to judge)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
                _remove(Path(entry.path))
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
            if alive is None:
                alive = now - info.st_mtime < LEGACY_STALE_S
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


def bound_downloads(folder: Path, now: float | None = None, keep: int = KEEP_DOWNLOADS) -> list[str]:
    """The node's bound: of this user's download entries in `folder`, the `keep` most recently used stay,
    and any used within BUSY_S (a live process may be reading it). Returns the names removed."""
    now = time.time() if now is None else now
    found = sorted(((e.stat(follow_symlinks=False).st_mtime, Path(e.path)) for e in _scan(folder) if _our_download(e)),
                   reverse=True)
    removed = []
    for used, path in found[keep:]:
        if now - used >= BUSY_S:
            _drop(path)
            removed.append(path.name)
    return removed


def forget_downloads(base: str, root: Path | None = None) -> list[str]:
    """A run's downloads on this node, removed when the run ends: the entries whose every file came from
    under `base` (its checkpoint root as the store names it, `UriStorage.base`). Returns the names removed."""
    folder = (cache_root() if root is None else root) / DOWNLOADS
    prefix = base.rstrip("/") + "/"
    removed = []
    for entry in _scan(folder):
        keys = [row[0] for row in read_manifest(Path(entry.path)) or [] if isinstance(row, list) and row]
        if _our_download(entry) and keys and all(isinstance(k, str) and k.startswith(prefix) for k in keys):
            _drop(Path(entry.path))
            removed.append(entry.name)
    return removed


def _drop(entry: Path) -> None:
    """Out of readers' sight first (one rename), then deleted."""
    aside = owned_tmp(".swap-", entry.parent)
    try:
        entry.rename(aside / "old")
    except OSError:
        pass
    shutil.rmtree(aside, ignore_errors=True)


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
    Another process installing the same entry at once: either copy is complete, one of them stays."""
    if entry.exists() and exchange(tmp, entry):
        shutil.rmtree(tmp, ignore_errors=True)  # now the previous copy
        return
    if entry.exists():
        _drop(entry)
    try:
        tmp.rename(entry)
    except OSError:  # another fetch installed it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)


def evict(entry: Path, family: str, keep: int) -> list[str]:
    """Drop the family's entries beyond the `keep` most recently used (`entry`, just installed, stays),
    then hold the node's bound (`bound_downloads`)."""
    others = [Path(e.path) for e in _scan(entry.parent) if e.name.startswith(f"{family}-")
              and e.is_dir(follow_symlinks=False) and e.path != str(entry)]
    others.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    removed = []
    for old in others[max(0, keep - 1):]:
        _drop(old)
        removed.append(old.name)
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
