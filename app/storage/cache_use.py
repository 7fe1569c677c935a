"""`python -m app.storage.cache_use [--runs 6] [--checkpoint-gb 6] [--export-gb 2] [--bound-gb 25]`: what
the download cache holds on one node after several URI runs, against its byte bound.

Each run resumes from a multi-GB checkpoint version and loads its export, as its ranks and its driver do
(`fetch.py`: a download pinned, installed, the node's bound held, then released once read); the runs end
on other nodes, so no `forget_downloads` runs here: the byte bound alone holds the disk. The files are
sparse (their sizes count, no disk is written) in a temp cache root. One line per run, then a RESULT
line: the cache's bytes (file sizes, what the bound counts) against the bound, and what the six runs
downloaded in all (what an unbounded cache would hold).
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

GIB = 1 << 30


def _sparse(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as out:
        out.truncate(size)


def fetch(location: str, files: dict[str, int]) -> Path:
    """What `fetch_dir` does for `location`, with sparse files in place of the download."""
    from app.storage import local_cache, pins

    entry, family, keep = local_cache.download_entry(location)
    tmp = local_cache.owned_tmp(".fetch-", entry.parent)
    held = pins.hold(tmp)
    for name, size in files.items():
        _sparse(tmp / "files" / name, size)
    (tmp / "location").write_text(location)
    local_cache.install(tmp, entry)
    pins.keep(entry, held)
    local_cache.evict(entry, family, keep)
    return local_cache.use(entry)


def used(folder: Path) -> tuple[int, int, int]:
    """(entries, bytes as the bound counts them, bytes on disk) of the download cache."""
    from app.storage import local_cache

    entries = [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")]
    disk = sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for e in entries for d, _, fs in os.walk(e) for f in fs)
    return len(entries), sum(local_cache.entry_bytes(e) for e in entries), disk


def main(argv: list[str] | None = None) -> int:
    from app.storage import local_cache
    from app.storage.fetch import release

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--checkpoint-gb", type=float, default=6.0, help="one checkpoint version (weights + optimizer)")
    parser.add_argument("--export-gb", type=float, default=2.0, help="the exported drafter")
    parser.add_argument("--bound-gb", type=float, default=25.0, help="checkpoint.download_cache_gb")
    args = parser.parse_args(argv)
    bound = int(args.bound_gb * GIB)
    ckpt = int(args.checkpoint_gb * GIB)
    with tempfile.TemporaryDirectory() as tmp:
        tempfile.tempdir = tmp  # the cache root goes under it: nothing of this node's real cache is touched
        local_cache.set_download_bound(bound)
        folder = local_cache.cache_root() / local_cache.DOWNLOADS
        total = 0
        for run in range(1, args.runs + 1):
            root = f"s3://bucket/run-{run}?endpoint_override=store:9000&scheme=http"
            version = root.replace("?", "/ckpt-00000500/v-0123456789ab?")
            resumed = fetch(version, {"drafter.safetensors": ckpt // 3, "trainer.pt": ckpt - ckpt // 3})
            export = fetch(root.replace("?", "/drafter?"), {"model.safetensors": int(args.export_gb * GIB), "config.json": 2})
            total += ckpt + int(args.export_gb * GIB) + 2
            release(resumed)  # read: the bound may evict it now
            release(export)
            n, size, disk = used(folder)
            print(f"run {run}: {n} entries, {size / GIB:.2f} GiB (bound {bound / GIB:.2f} GiB), {disk / GIB:.3f} GiB on disk; "
                  f"{total / GIB:.2f} GiB downloaded so far")
        n, size, _ = used(folder)
        print(f"RESULT runs={args.runs} cache_gib={size / GIB:.2f} bound_gib={bound / GIB:.2f} "
              f"downloaded_gib={total / GIB:.2f} entries={n} within_bound={size <= bound} "
              f"cache_bytes={size} bound_bytes={bound} downloaded_bytes={total}")
        tempfile.tempdir = None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
