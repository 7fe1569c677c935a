"""One sequence's stored features as bytes: `MAGIC`, a 4-byte header length, a JSON header, raw arrays.

    header: {"name": <sequence_name>, "length": L, "width": D, "dtype": <payload dtype>,
             "scales": bool, "body_bytes": n, "sha256": <hex of the body>, "job_id": <writer's job>}
    body:   features [L, D] (bf16 as uint16 bits, FP8 as uint8 codes), then FP8's float32 scales [L]

Only the sequence's real positions are kept (no padding). Every read checks the magic, the header's
fields against what the reader expects (name, length, dtype), the body's size against the header and
its sha256: anything off is `BadEntry`, and the caller runs the target instead.
"""
from __future__ import annotations

import hashlib
import json
import struct

import numpy as np

MAGIC = b"DFRPLY01"
MAX_HEADER = 4096
MAX_WIDTH = 1 << 20
NUMPY_DTYPES = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32, "float8_e4m3": np.uint8}


class BadEntry(ValueError):
    """A stored entry that is not what its name promises (truncated, corrupt, another sequence or dtype)."""


def encode_entry(name: str, rows_LD: np.ndarray, dtype: str, scales_L: np.ndarray | None = None,
                 job_id: int = -1) -> bytes:
    """The file's bytes for one sequence's features `rows_LD` (the payload's own dtype) and FP8 scales."""
    rows = np.ascontiguousarray(rows_LD)
    assert rows.dtype == NUMPY_DTYPES[dtype] and rows.ndim == 2, (rows.dtype, rows.shape, dtype)
    body = rows.tobytes()
    if scales_L is not None:
        body += np.ascontiguousarray(scales_L, dtype=np.float32).tobytes()
    header = json.dumps({"name": name, "length": int(rows.shape[0]), "width": int(rows.shape[1]), "dtype": dtype,
                         "scales": scales_L is not None, "body_bytes": len(body),
                         "sha256": hashlib.sha256(body).hexdigest(), "job_id": int(job_id)}).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + body


def decode_entry(data: bytes, name: str, length: int, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(features [length, D], scales [length] or None) of the entry `data` for sequence `name`, checked."""
    header, body = _split(data)
    expect = {"name": name, "length": length, "dtype": dtype}
    for field, want in expect.items():
        if header.get(field) != want:
            raise BadEntry(f"{field} {header.get(field)!r} where {want!r} was asked for")
    width, scaled = header.get("width"), header.get("scales")
    if not isinstance(width, int) or not 0 < width <= MAX_WIDTH or not isinstance(scaled, bool):
        raise BadEntry(f"width {width!r} / scales {scaled!r} out of range")
    item = np.dtype(NUMPY_DTYPES[dtype]).itemsize
    size = length * width * item + (4 * length if scaled else 0)
    if header.get("body_bytes") != size or len(body) != size:
        raise BadEntry(f"body of {len(body)} bytes, header {header.get('body_bytes')!r}, shape needs {size}")
    if hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise BadEntry("the body's sha256 differs from its header's")
    rows = np.frombuffer(body, dtype=NUMPY_DTYPES[dtype], count=length * width).reshape(length, width)
    scales = np.frombuffer(body, dtype=np.float32, offset=length * width * item) if scaled else None
    return rows, scales


def _split(data: bytes) -> tuple[dict, memoryview]:
    if len(data) < len(MAGIC) + 4 or data[:len(MAGIC)] != MAGIC:
        raise BadEntry("no replay entry magic")
    (n,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    if n > MAX_HEADER or start + n > len(data):
        raise BadEntry(f"header of {n} bytes does not fit")
    try:
        header = json.loads(bytes(data[start:start + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadEntry(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise BadEntry("header is not a JSON object")
    return header, memoryview(data)[start + n:]
