"""The names this project writes into a local checkpoint folder for a moment, and the start-up
cleanup that removes what a crash left of them: only those names, never a user's file.

Every such name starts with one fixed prefix, `.dflash-`: staging folders `.dflash-tmp-<name>-<8 hex>/`
(`LocalStorage.stage`), the copy a rewrite sets aside `.dflash-old-<name>/` (`LocalStorage.publish`),
and rank 0's probe file `.dflash-probe-<12 hex>`. The names older versions wrote (`.tmp-<name>-<8 hex>`,
`.tmp-ckpt-<step>`, `drafter-best.tmp-<pid>`, `.old-ckpt-<step>`, `.probe-<12 hex>`, ...) are matched
whole too. Before, any name holding `.tmp-` or `.old-` was deleted (a user's `notes.tmp-1`).
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

STAGING_PREFIX = ".dflash-tmp-"
ASIDE_PREFIX = ".dflash-old-"
PROBE_PREFIX = ".dflash-probe-"

_STAGING = re.compile(r"\.dflash-tmp-.+-[0-9a-f]{8}|\.tmp-(?:ckpt-\d{8}|.+-[0-9a-f]{8})|drafter-best\.(?:tmp|old)-\d+")
_ASIDE = re.compile(r"\.dflash-old-(?P<name>.+)|\.old-(?P<legacy>ckpt-\d{8}|drafter(?:-best)?)")
_PROBE = re.compile(r"\.(?:dflash-)?probe-[0-9a-f]{12}")


def staging_name(name: str, nonce: str) -> str:
    """The staging folder of entry `name` (`nonce`: 8 hex digits, unique per writer)."""
    return f"{STAGING_PREFIX}{name}-{nonce}"


def aside_name(name: str) -> str:
    """Where a rewrite of entry `name` sets the previous copy aside until the new one is in place."""
    return f"{ASIDE_PREFIX}{name}"


def _plain(name: str) -> bool:
    """A name a set-aside copy can be put back under: not `.` or `..` (a planted `.dflash-old-.` would
    name the folder itself), no separator, no NUL. Anything else is not ours and is left alone."""
    return name not in ("", ".", "..") and "/" not in name and "\x00" not in name


def clean_orphans(root: Path) -> list[str]:
    """Remove the staging folders and probes a crash left in `root`, and put back a set-aside copy whose
    replacement never landed (or remove it when it did). Names this project never writes are left
    alone. Returns what it did ("removed <name>", "restored <name>")."""
    done = []
    for p in sorted(Path(root).iterdir()):
        if p.is_symlink():
            continue  # never written by us: a planted link is not followed, nor removed
        if (p.is_dir() and _STAGING.fullmatch(p.name)) or (p.is_file() and _PROBE.fullmatch(p.name)):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            done.append(f"removed {p.name}")
        elif p.is_dir() and (m := _ASIDE.fullmatch(p.name)) and _plain(m["name"] or m["legacy"]):
            final = p.with_name(m["name"] or m["legacy"])
            if final.exists() or final.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
                done.append(f"removed {p.name}")
            else:
                p.rename(final)
                done.append(f"restored {final.name}")
    return done
