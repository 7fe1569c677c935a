"""What the pool keeps per job, compactly: its state, its JobSpec (made on demand) and its ack.

Job states made explicit: every job the pool knows is in exactly one of them.

    PENDING ──issue──► IN_FLIGHT ──lands──► BUFFERED ──pull──► LEASED ──ack──► ACKED
       ▲                   │ target failed/lost                  │ released / payload lost
       └───────────────────┴─────────────────────────────────────┘
    IN_FLIGHT ──forward failed the second time──► QUARANTINED   (final: never trained, never acked)
    ACKED ──rollback──► PENDING      (re)stored ledger: unknown/PENDING ──► ACKED
    PENDING (in flight: dropped first) / BUFFERED ──rollback to a ledger holding the job──► ACKED

All three records are per epoch, indexed by the job's index in it (`split_job_id`): a state byte
(`JobStates`), the epoch's schedule arrays (`JobCatalog`: every job added, specs made when asked for)
and an acked bit (`Ledger`, saved with each checkpoint). A dict of ids would cost ~100 bytes a job.
"""
from __future__ import annotations

import base64
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

import numpy as np

from app.data.schedule import EpochJobs
from app.messages import JobSpec, make_job_id, split_job_id


class JobState(str, Enum):
    PENDING = "pending"  # in the job queue
    IN_FLIGHT = "in_flight"  # on a target
    BUFFERED = "buffered"  # produced, in a bucket
    LEASED = "leased"  # pulled by a drafter, not acked
    ACKED = "acked"  # in the ledger
    QUARANTINED = "quarantined"  # a poison job: its forward failed twice; set aside for good


_LEGAL: dict[JobState | None, frozenset[JobState]] = {
    None: frozenset({JobState.PENDING, JobState.ACKED}),
    JobState.PENDING: frozenset({JobState.IN_FLIGHT, JobState.ACKED}),
    JobState.IN_FLIGHT: frozenset({JobState.BUFFERED, JobState.PENDING, JobState.QUARANTINED}),
    JobState.BUFFERED: frozenset({JobState.LEASED, JobState.ACKED}),
    JobState.LEASED: frozenset({JobState.ACKED, JobState.PENDING}),
    JobState.ACKED: frozenset({JobState.PENDING}),
    JobState.QUARANTINED: frozenset(),
}


_STATES = (None, *JobState)  # code k of a state byte; 0 = unknown
_CODE = {state: k for k, state in enumerate(_STATES)}


class JobStates:
    """The state of every known job id, with per-state counts kept in step (O(1) stats).

    One byte per job: per epoch, a bytearray indexed by the job's index (`split_job_id`), grown as ids
    arrive or sized at once by `add_epoch`; a dict of ids would cost ~100 bytes per queued job."""

    def __init__(self) -> None:
        self._codes: dict[int, bytearray] = {}  # epoch -> state code per job index
        self._count = dict.fromkeys(JobState, 0)

    def move(self, job_id: int, to: JobState) -> None:
        """Record a transition; an illegal one is a bug in the pool, not a user error."""
        epoch, index = split_job_id(job_id)
        codes = self._codes.setdefault(epoch, bytearray())
        if index >= len(codes):
            codes.extend(bytes(max(index + 1 - len(codes), len(codes) // 2)))  # grow geometrically
        frm = _STATES[codes[index]]
        assert to in _LEGAL[frm], f"job {job_id}: illegal transition {frm} -> {to}"
        if frm is not None:
            self._count[frm] -= 1
        codes[index] = _CODE[to]
        self._count[to] += 1

    def add_epoch(self, epoch: int, pending: np.ndarray) -> None:
        """Jobs `flatnonzero(pending)` of `epoch` become PENDING at once (a whole epoch's schedule).
        Each must be unknown so far; the caller checks that (`known`) to name the fix."""
        codes = self._codes.setdefault(epoch, bytearray())
        if len(codes) < len(pending):
            codes.extend(bytes(len(pending) - len(codes)))
        view = np.frombuffer(codes, dtype=np.uint8, count=len(pending))  # writes through to `codes`
        assert not view[pending].any(), f"epoch {epoch}: a job added twice"
        view[pending] = _CODE[JobState.PENDING]
        self._count[JobState.PENDING] += int(np.count_nonzero(pending))

    def known(self, epoch: int, n: int) -> np.ndarray:
        """bool [n]: whether job index k of `epoch` has a state (a copy)."""
        codes = self._codes.get(epoch, bytearray())
        out = np.zeros(n, dtype=bool)
        m = min(n, len(codes))
        out[:m] = np.frombuffer(codes, dtype=np.uint8, count=m) != 0
        return out

    def get(self, job_id: int) -> JobState | None:
        epoch, index = split_job_id(job_id)
        codes = self._codes.get(epoch)
        return _STATES[codes[index]] if codes is not None and index < len(codes) else None

    def count(self, state: JobState) -> int:
        return self._count[state]

    def counts(self) -> dict[str, int]:
        """{state name: jobs}, in life-cycle order."""
        return {s.value: self._count[s] for s in JobState}

    def __contains__(self, job_id: int) -> bool:
        return self.get(job_id) is not None

    def __len__(self) -> int:
        return sum(self._count.values())


# ---- the catalog: every job the pool was given ---------------------------------------------------
# The run adds whole epochs (`EpochJobs`, whose arrays arrive zero-copy from the object store, so they
# are not pool heap); tests and benches may add single JobSpecs, which are kept as given. A job id is
# "added" when it was queued: an epoch's jobs acked in a restored ledger when the epoch arrived were
# skipped, so they are not (a rollback never re-queues them, as before).
def pack_bits(mask: np.ndarray) -> bytearray:
    """A little-endian bitmap of a bool array (bit k of byte k // 8 is mask[k]), as the ledger keeps them."""
    return bytearray(np.packbits(np.asarray(mask, dtype=bool), bitorder="little").tobytes())


def bit(bits: bytearray, index: int) -> bool:
    return bool(bits[index >> 3] & (1 << (index & 7)))


@dataclass
class _Epoch:
    jobs: EpochJobs
    bytes_per_token: int
    not_added: bytearray  # bitmap over the epoch's job indices: skipped when the epoch was added


class JobCatalog:
    """job id -> JobSpec for every job added, made on demand from its epoch's arrays (or kept as given)."""

    def __init__(self) -> None:
        self._epochs: dict[int, _Epoch] = {}
        self._specs: dict[int, JobSpec] = {}  # jobs added one by one (`HSPool.add_jobs`)

    def add_epoch(self, jobs: EpochJobs, bytes_per_token: int, skipped: np.ndarray) -> None:
        """`skipped` (bool per job of the epoch) marks the jobs that were not queued."""
        assert jobs.epoch not in self._epochs, f"epoch {jobs.epoch} added twice"
        self._epochs[jobs.epoch] = _Epoch(jobs, bytes_per_token, pack_bits(skipped))

    def add_spec(self, job: JobSpec) -> None:
        self._specs[job.job_id] = job

    def has_epoch(self, epoch: int) -> bool:
        return epoch in self._epochs

    def spec(self, job_id: int) -> JobSpec:
        """The job's JobSpec; est_bytes is its epoch's `payload_bytes` at the epoch's bytes per token."""
        job = self._specs.get(job_id)
        if job is not None:
            return job
        epoch, index = split_job_id(job_id)
        e = self._epochs[epoch]
        return e.jobs.spec(index, e.bytes_per_token)

    def bucket(self, job_id: int) -> int:
        job = self._specs.get(job_id)
        if job is not None:
            return job.bucket
        epoch, index = split_job_id(job_id)
        return int(self._epochs[epoch].jobs.bucket[index])

    def __contains__(self, job_id: int) -> bool:
        """Whether the job was added (queued at least once)."""
        if job_id in self._specs:
            return True
        epoch, index = split_job_id(job_id)
        e = self._epochs.get(epoch)
        return e is not None and index < len(e.jobs) and not bit(e.not_added, index)


# ---- the ledger of acked job ids: saved with each checkpoint, restored on resume ------------------
# A small interface on purpose (add, discard, membership, size, ids, the ids outside a kept set, one
# epoch's acked mask). Behind it, one bitmap per epoch: bit `index` of epoch `e`'s bitmap is job
# `make_job_id(e, index)`, so the ledger costs an eighth of a byte per scheduled job (600K jobs: 75 KB)
# instead of a Python int in a set (~60 bytes each). Checkpoints store the same bitmaps (`to_json` /
# `ids_from_state`), base64-encoded.
class Ledger:
    """Acked job ids as one bitmap per epoch."""

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self._bits: dict[int, bytearray] = {}  # epoch -> little-endian bitmap over job indices
        self._count = 0
        for job_id in ids:
            self.add(job_id)

    def add(self, job_id: int) -> None:
        epoch, index = split_job_id(job_id)
        bits = self._bits.setdefault(epoch, bytearray())
        byte, mask = index >> 3, 1 << (index & 7)
        if byte >= len(bits):
            bits.extend(bytes(max(byte + 1 - len(bits), len(bits) // 2)))  # grow geometrically
        if not bits[byte] & mask:
            bits[byte] |= mask
            self._count += 1

    def discard(self, job_id: int) -> None:
        epoch, index = split_job_id(job_id)
        bits = self._bits.get(epoch)
        byte, mask = index >> 3, 1 << (index & 7)
        if bits is not None and byte < len(bits) and bits[byte] & mask:
            bits[byte] &= ~mask & 0xFF
            self._count -= 1

    def __contains__(self, job_id: int) -> bool:
        epoch, index = split_job_id(job_id)
        bits = self._bits.get(epoch)
        return bits is not None and (index >> 3) < len(bits) and bool(bits[index >> 3] & (1 << (index & 7)))

    def __len__(self) -> int:
        return self._count

    def mask(self, epoch: int, n: int) -> np.ndarray:
        """bool [n]: whether job index k of `epoch` is acked (a copy; for adding a whole epoch at once)."""
        out = np.zeros(n, dtype=bool)
        bits = self._bits.get(epoch)
        if bits:
            acked = np.unpackbits(np.frombuffer(bytes(bits), np.uint8), bitorder="little")[:n].astype(bool)
            out[:len(acked)] = acked
        return out

    def ids(self) -> list[int]:
        """Every acked id, sorted."""
        out: list[int] = []
        for epoch in sorted(self._bits):
            out.extend(make_job_id(epoch, 0) + i for i in _set_bits(self._bits[epoch]).tolist())
        return out

    def not_in(self, keep: Iterable[int]) -> list[int]:
        """Acked ids outside `keep` (a checkpoint's ledger), sorted."""
        kept = Ledger(keep)
        return [j for j in self.ids() if j not in kept]

    def to_json(self) -> dict[str, str]:
        """{epoch: base64 of its bitmap}, what a checkpoint stores."""
        return {str(e): base64.b64encode(bytes(b).rstrip(b"\0")).decode() for e, b in sorted(self._bits.items())}

    @classmethod
    def from_json(cls, blob: dict[str, str]) -> "Ledger":
        ledger = cls()
        for epoch, text in blob.items():
            bits = bytearray(base64.b64decode(text))
            ledger._bits[int(epoch)] = bits
            ledger._count += int(np.unpackbits(np.frombuffer(bytes(bits), np.uint8)).sum())
        return ledger


def _set_bits(bits: bytearray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(np.frombuffer(bytes(bits), np.uint8), bitorder="little"))


def to_json(ids: Iterable[int]) -> dict[str, str]:
    """The checkpoint form of a ledger given as job ids."""
    return Ledger(ids).to_json()


def ids_from_state(meta: dict) -> list[int]:
    """The ledger of a checkpoint's state.json: per-epoch bitmaps, or the sorted id list older ones hold."""
    if "ledger_bitmaps" in meta:
        return Ledger.from_json(meta["ledger_bitmaps"]).ids()
    ids = meta["ledger"]
    if not isinstance(ids, list) or not all(type(j) is int and j >= 0 for j in ids):  # JSON true is no job id
        raise ValueError("the checkpoint's ledger is not a list of non-negative integer job ids; the checkpoint is "
                         "damaged or was not written by this trainer: resume from another one")
    return list(ids)
