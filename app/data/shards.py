"""Input files cut into shards of consecutive records, each readable on its own with its line numbers.

A shard is a JSONL byte range that starts at a line (with the number of that line) or a row range
of one Parquet row group (with the number of its first row). Reading every shard of a file in order
gives exactly the records `iter_records` gives for the whole file, with the same line numbers, so
the parallel tokenizer can report the same file and line as the single-process one.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from app.data.records import DataError, MalformedRecord

_READ_CHUNK = 1 << 22  # bytes per read while finding line starts
# The longest JSONL line read: a longer one is a malformed record, skipped without being held in memory
# (a 200 MB line was read, then parsed, whole). 16 MiB is a 128k-token conversation written with JSON's
# six-byte \u escapes several times over; a sequence is cut at data.max_length tokens anyway. A Parquet
# row's cells are capped at the same size.
MAX_LINE_BYTES = 16 << 20
_LINE_PIECE = 1 << 20  # bytes a line is read in


@dataclass(frozen=True)
class Shard:
    """Records of `path`: JSONL bytes [start, stop) whose first line is `first`, or Parquet rows
    [start, stop) of row group `row_group` whose first row is number `first` in the file."""

    path: str
    kind: str  # "jsonl" | "parquet"
    start: int
    stop: int
    first: int  # line (JSONL) or row (Parquet) number of the shard's first record, from 1
    row_group: int = 0
    records: int = 0  # lines (JSONL, blank ones included) or rows in the shard, for progress


def file_kind(path: str) -> str:
    p = Path(path)
    if not p.exists():
        raise DataError(f"data file {path!r} does not exist; fix data.train_files")
    if p.is_dir():  # a folder named *.jsonl would fail reading with a traceback
        raise DataError(f"data file {path!r} is a directory; list the files in it in data.train_files")
    if p.suffix == ".parquet":
        return "parquet"
    if p.suffix in (".jsonl", ".json"):
        return "jsonl"
    raise DataError(f"data file {path!r}: unknown extension {p.suffix!r}; use .jsonl or .parquet")


def whole_file(path: str) -> list[Shard]:
    """The file as shards without cutting it (one per Parquet row group): the single-process path."""
    return plan_shards(path, records_per_shard=0)


def plan_shards(path: str, records_per_shard: int) -> list[Shard]:
    """`path` cut into shards of about `records_per_shard` records (0 = as few shards as possible)."""
    if file_kind(path) == "parquet":
        return _parquet_shards(path, records_per_shard)
    return _jsonl_shards(path, records_per_shard)


def _jsonl_shards(path: str, per: int) -> list[Shard]:
    size = Path(path).stat().st_size
    if per <= 0:
        return [Shard(path, "jsonl", 0, size, 1, records=count_lines(path))]
    cuts = [(0, 1)]  # (byte offset, line number) of each shard start
    line, offset = 1, 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            pos = chunk.find(b"\n")
            while pos >= 0:
                line += 1
                if (line - 1) % per == 0:
                    cuts.append((offset + pos + 1, line))
                pos = chunk.find(b"\n", pos + 1)
            offset += len(chunk)
    if cuts[-1][0] >= size and len(cuts) > 1:
        cuts.pop()  # the file ends with a newline: no record after it
    ends = [c[0] for c in cuts[1:]] + [size]
    return [Shard(path, "jsonl", start, stop, first, records=(ends_line - first))
            for (start, first), stop, ends_line in zip(cuts, ends, [c[1] for c in cuts[1:]] + [line + 1])]


def count_lines(path: str) -> int:
    """Lines in a file (a last line without a newline counts)."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def _open_parquet(path: str):
    """The file's ParquetFile; one that cannot be opened (truncated, not Parquet) is a DataError."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"data file {path!r} is not a readable Parquet file ({first}); re-export it or remove "
                        "it from data.train_files") from None


def _parquet_shards(path: str, per: int) -> list[Shard]:
    meta = _open_parquet(path).metadata
    shards, first = [], 1
    for rg in range(meta.num_row_groups):
        rows = meta.row_group(rg).num_rows
        step = per if per > 0 else max(rows, 1)
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            shards.append(Shard(path, "parquet", lo, hi, first + lo, row_group=rg, records=hi - lo))
        first += rows
    return shards


def read_shard(shard: Shard) -> Iterator[tuple[int, dict | MalformedRecord]]:
    """(line or row number from 1, record or MalformedRecord) of every record in the shard."""
    if shard.kind == "parquet":
        yield from _read_parquet(shard)
    else:
        yield from _read_jsonl(shard)


def _read_jsonl(shard: Shard) -> Iterator[tuple[int, dict | MalformedRecord]]:
    with open(shard.path, "rb") as f:
        f.seek(shard.start)
        line_no, pos = shard.first, shard.start
        while pos < shard.stop:
            raw, size = _read_line(f)
            if not size:
                break
            pos += size
            if raw is None:
                yield line_no, MalformedRecord(f"line of {size} bytes is longer than the {MAX_LINE_BYTES >> 20} MiB a "
                                               "record may take: not read; shorten or split the record")
            elif raw.strip():  # blank lines are not records
                yield line_no, _parse_line(raw)
            line_no += 1


def _read_line(f) -> tuple[bytes | None, int]:
    """(the next line, or None when it is longer than MAX_LINE_BYTES; its size in bytes, 0 at the end).
    Read a piece at a time, and the pieces of a line over the cap are dropped as soon as it is."""
    parts: list[bytes] | None = []
    size = 0
    while piece := f.readline(_LINE_PIECE):
        size += len(piece)
        if parts is not None and size - piece.endswith(b"\n") > MAX_LINE_BYTES:
            parts = None
        elif parts is not None:
            parts.append(piece)
        if piece.endswith(b"\n"):
            break
    return (b"".join(parts) if parts is not None else None), size


def _parse_line(raw: bytes) -> dict | MalformedRecord:
    try:
        rec = json.loads(raw)
    except UnicodeDecodeError as e:
        return MalformedRecord(f"invalid UTF-8: {e}")
    except json.JSONDecodeError as e:
        return MalformedRecord(f"invalid JSON: {e}")
    except RecursionError:  # json's decoder recurses once per nesting level
        return MalformedRecord("JSON nested too deeply")
    return rec if isinstance(rec, dict) else MalformedRecord("record is not a JSON object")


def _read_parquet(shard: Shard) -> Iterator[tuple[int, dict | MalformedRecord]]:
    import pyarrow as pa

    try:
        table = _open_parquet(shard.path).read_row_group(shard.row_group).slice(shard.start, shard.stop - shard.start)
    except (pa.ArrowException, OSError) as e:  # a corrupt row group: each of its rows is a malformed record
        why = MalformedRecord(f"unreadable Parquet row group {shard.row_group}: {str(e).strip().splitlines()[0]}")
        for row in range(shard.first, shard.first + shard.stop - shard.start):
            yield row, why
        return
    row = shard.first
    for batch in table.to_batches(max_chunksize=1024):
        for rec in _rows(batch):
            yield row, rec
            row += 1


def _rows(batch) -> Iterator[dict | MalformedRecord]:
    """The batch's rows as records; a row whose cells hold more than MAX_LINE_BYTES (the JSONL line's
    cap) is a malformed record, never turned into Python objects (a copy of it as large again)."""
    if batch.nbytes <= MAX_LINE_BYTES:  # the common case: no row can be over, no per-row sizes
        yield from batch.to_pylist()
        return
    for i in range(batch.num_rows):
        row = batch.slice(i, 1)
        if row.nbytes > MAX_LINE_BYTES:  # the bytes its cells reference (slice offsets counted)
            yield MalformedRecord(f"row of {row.nbytes} bytes is longer than the {MAX_LINE_BYTES >> 20} MiB a record "
                                  "may take: not read; shorten or split the record")
        else:
            yield row.to_pylist()[0]
