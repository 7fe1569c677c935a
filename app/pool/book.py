# Over 300 lines: a job's records (state, spec, ack) and the places the book holds it (queue, in flight) move together.
"""The pool's book (`JobBook`): every job it was given and where each one is; the one state its producing
side and its drafters' side (`sides.py`) share, so each is handed the book, not a dozen parts. Jobs enter as
whole epochs (`add_epoch`, the run's path) or JobSpec lists (`add_jobs`, tests and benches), checked, with
the ids of a restored ledger skipped. The errors name the bad job and the fix: jobs come from the driver's
schedule, so they mean a caller built them wrong.

Job states made explicit: every job the pool knows is in exactly one of them.

    PENDING ──issue──► IN_FLIGHT ──lands──► BUFFERED ──pull──► LEASED ──ack──► ACKED
       ▲                   │ target failed/lost                  │ released / payload lost
       └───────────────────┴─────────────────────────────────────┘
    IN_FLIGHT ──forward failed the second time──► QUARANTINED   (final: never trained, never acked)
    ACKED ──rollback──► PENDING      (re)stored ledger: unknown/PENDING ──► ACKED
    PENDING (in flight: dropped first) / BUFFERED ──rollback to a ledger holding the job──► ACKED

What it keeps per job, compactly: all three records are per epoch, indexed by the job's index in it
(`split_job_id`): a state byte (`JobStates`), the epoch's schedule arrays (`JobCatalog`: every job added,
specs made when asked for) and an acked bit (`Ledger`, saved with each checkpoint). A dict of ids would
cost ~100 bytes a job.

The job queue, shared by all targets: pending jobs, in schedule order, re-queued ones in front.
Compact: an epoch's jobs wait as a cursor over its schedule (the next index, and a bitmap of indices
to skip: acked in a restored ledger), re-queued jobs as ids; a JobSpec is made from the catalog only
for the job at the head (`peek`, `pop`). So the queue costs an eighth of a byte per queued job of an
added epoch instead of a JobSpec (~1.4 KB with its sequence tuple). Jobs added one by one (tests,
benches) wait as ids in the same order.
"""
from __future__ import annotations

import base64
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum

import numpy as np

from app.data.schedule import EpochJobs
from app.messages import JobSpec, make_job_id, split_job_id
from app.pool.holdings import BucketBuffer, Budget, LeaseTable
from app.pool.telemetry import PoolTelemetry


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


class _EpochCursor:
    """One epoch's pending jobs in schedule order: indices next..n-1 whose skip bit is clear."""

    __slots__ = ("epoch", "n", "next", "skip", "left")

    def __init__(self, epoch: int, skipped: np.ndarray) -> None:
        self.epoch = epoch
        self.n = len(skipped)
        self.next = 0
        self.skip = pack_bits(skipped)  # its own copy: `remove` sets bits the catalog must not see
        self.left = self.n - int(np.count_nonzero(skipped))

    def first(self) -> int | None:
        """The next index to issue (skipped ones passed over for good), or None when none is left."""
        while self.next < self.n:
            if self.next & 7 == 0 and self.skip[self.next >> 3] == 0xFF:
                self.next += 8  # a whole byte of restored jobs (a resume skips many)
            elif bit(self.skip, self.next):
                self.next += 1
            else:
                return self.next
        return None

    def drop(self, index: int) -> bool:
        """Skip job `index` if it is still ahead; True when that removed a queued job."""
        if not self.next <= index < self.n or bit(self.skip, index):
            return False
        self.skip[index >> 3] |= 1 << (index & 7)
        self.left -= 1
        return True


class JobQueue:
    """FIFO of pending jobs. Jobs that come back (a failed target, a released lease, a rollback)
    go to the FRONT, in the order given, so they are recomputed first. The catalog it makes JobSpecs
    from is filled by its appends."""

    def __init__(self, catalog: JobCatalog | None = None) -> None:
        self.catalog = catalog if catalog is not None else JobCatalog()
        self._front: deque[int] = deque()  # re-queued job ids
        self._parts: deque[_EpochCursor | deque[int]] = deque()  # in add order; deque: ids added one by one
        self._len = 0
        self._head: JobSpec | None = None  # the JobSpec `peek` made, reused while it is still the head

    def append(self, job: JobSpec) -> None:
        self.catalog.add_spec(job)
        if not self._parts or not isinstance(self._parts[-1], deque):
            self._parts.append(deque())
        self._parts[-1].append(job.job_id)
        self._len += 1

    def append_epoch(self, jobs: EpochJobs, bytes_per_token: int, skipped: np.ndarray) -> None:
        """Every job of the epoch in schedule order, but those marked in `skipped` (bool per job)."""
        self.catalog.add_epoch(jobs, bytes_per_token, skipped)
        cursor = _EpochCursor(jobs.epoch, skipped)
        if cursor.left:
            self._parts.append(cursor)
            self._len += cursor.left

    def push_front(self, job_ids: Iterable[int]) -> None:
        """Put jobs back at the front; the first of `job_ids` becomes the next one issued."""
        ids = list(job_ids)
        self._front.extendleft(reversed(ids))
        self._len += len(ids)

    def peek(self) -> JobSpec | None:
        job_id = self._head_id()
        if job_id is None:
            return None
        if self._head is None or self._head.job_id != job_id:
            self._head = self.catalog.spec(job_id)
        return self._head

    def pop(self) -> JobSpec:
        job = self.peek()
        if job is None:
            raise IndexError("pop from an empty JobQueue")
        if self._front:
            self._front.popleft()
        else:
            part = self._parts[0]  # _head_id left the head part first
            if isinstance(part, deque):
                part.popleft()
            else:
                part.next += 1
                part.left -= 1
        self._len -= 1
        self._head = None
        return job

    def remove(self, job_ids: set[int]) -> None:
        """Drop these ids (a restored ledger: they are never issued again)."""
        front = deque(j for j in self._front if j not in job_ids)
        removed = len(self._front) - len(front)
        self._front = front
        cursors = {}
        for i, part in enumerate(list(self._parts)):
            if isinstance(part, deque):
                kept = deque(j for j in part if j not in job_ids)
                removed += len(part) - len(kept)
                self._parts[i] = kept
            else:
                cursors[part.epoch] = part
        if cursors:
            for job_id in job_ids:
                epoch, index = split_job_id(job_id)
                cursor = cursors.get(epoch)
                if cursor is not None and cursor.drop(index):
                    removed += 1
        self._len -= removed

    def __len__(self) -> int:
        return self._len

    def _head_id(self) -> int | None:
        """The id of the next job, dropping spent parts from the head."""
        if self._front:
            return self._front[0]
        while self._parts:
            part = self._parts[0]
            if isinstance(part, deque):
                if part:
                    return part[0]
            else:
                index = part.first()
                if index is not None:
                    return make_job_id(part.epoch, index)
            self._parts.popleft()
        return None


@dataclass
class InFlightJob:
    """A job on a target: which target, since when, and the bytes reserved for its payload."""

    job: JobSpec
    target_id: int
    start: float
    reserved_bytes: int


class InFlight:
    """job id -> InFlightJob, with per-target counts for the job slots."""

    def __init__(self) -> None:
        self._jobs: dict[int, InFlightJob] = {}
        self._per_target: dict[int, int] = {}

    def start(self, job: JobSpec, target_id: int, now: float, reserved_bytes: int) -> None:
        assert job.job_id not in self._jobs, f"job {job.job_id} issued twice"
        self._jobs[job.job_id] = InFlightJob(job, target_id, now, reserved_bytes)
        self._per_target[target_id] = self._per_target.get(target_id, 0) + 1

    def get(self, job_id: int) -> InFlightJob | None:
        return self._jobs.get(job_id)

    def pop(self, job_id: int) -> InFlightJob:
        fl = self._jobs.pop(job_id)
        self._per_target[fl.target_id] -= 1
        return fl

    def of_target(self, target_id: int) -> list[int]:
        return [jid for jid, fl in self._jobs.items() if fl.target_id == target_id]

    def count(self, target_id: int) -> int:
        return self._per_target.get(target_id, 0)

    def by_target(self) -> dict[int, list[tuple[int, float]]]:
        """target -> [(job id, start)], for stats and the watchdog."""
        out: dict[int, list[tuple[int, float]]] = {}
        for jid, fl in self._jobs.items():
            out.setdefault(fl.target_id, []).append((jid, fl.start))
        return out

    def __len__(self) -> int:
        return len(self._jobs)


class JobBook:
    """Where every job is, kept in step by both sides of the pool: its state (`states`), its JobSpec
    (`catalog`), its place in the `queue`, `in_flight`, the `buffer` or the `leases`, its ack (`ledger`),
    and the byte `budget`; with the counters (`tel`), the clock and `changed`, which every side calls after
    a change (the pool wakes its waiters). Jobs enter here and are refused after `finished`: unique ids,
    a bucket the pool has, a payload that fits."""

    def __init__(self, num_buckets: int, capacity: int, capacity_bytes: int,
                 queue: Callable[[JobCatalog], JobQueue] = JobQueue, clock: Callable[[], float] = time.monotonic,
                 changed: Callable[[], None] = lambda: None) -> None:
        """`queue` builds the job queue over the catalog (a test passes a reference queue)."""
        self.num_buckets = num_buckets
        self.states = JobStates()
        self.catalog = JobCatalog()  # every job added, for re-queueing on rollback
        self.queue = queue(self.catalog)
        self.ledger = Ledger()
        self.in_flight = InFlight()
        self.buffer = BucketBuffer(num_buckets)
        self.leases = LeaseTable()
        self.budget = Budget(capacity, capacity_bytes, num_buckets)
        self.tel = PoolTelemetry(num_buckets)
        self.clock, self.changed = clock, changed
        self.finished = False  # no more jobs will be added

    def add_jobs(self, jobs: Iterable[JobSpec]) -> list[int]:
        """Queue these jobs but the acked ones; returns how many per bucket (so does `add_epoch`)."""
        self._refuse_after_finish("add_jobs")
        added = [0] * self.num_buckets
        for job in jobs:
            if job.job_id in self.ledger:
                continue
            self._check_job(job)
            self.states.move(job.job_id, JobState.PENDING)
            self.queue.append(job)
            added[job.bucket] += 1
        return added

    def add_epoch(self, jobs: EpochJobs, bytes_per_token: int) -> list[int]:
        self._refuse_after_finish("add_epoch")
        skipped = self.ledger.mask(jobs.epoch, len(jobs))
        queued = ~skipped
        self._check_epoch(jobs, bytes_per_token, queued)
        self.states.add_epoch(jobs.epoch, queued)
        self.queue.append_epoch(jobs, bytes_per_token, skipped)
        return np.bincount(jobs.bucket[queued], minlength=self.num_buckets).tolist()

    def restore(self, acked_ids: Iterable[int]) -> None:
        """Jobs acked by a previous run (from a checkpoint) join the ledger and leave the queue."""
        ids = set(acked_ids)
        for jid in ids:
            if jid not in self.ledger:
                self.states.move(jid, JobState.ACKED)
                self.ledger.add(jid)
        self.queue.remove(ids)

    def _refuse_after_finish(self, call: str) -> None:
        if self.finished:
            raise ValueError(f"{call} after finish_adding: add every job of the run first")

    def _check_job(self, job: JobSpec) -> None:
        if job.job_id in self.states:
            raise ValueError(_twice(job.job_id))
        if not 0 <= job.bucket < self.num_buckets:
            raise ValueError(self._bad_bucket(job.job_id, job.bucket))
        if job.est_bytes > self.budget.capacity_bytes:
            raise ValueError(self._too_big(job.job_id, job.est_bytes))

    def _check_epoch(self, jobs: EpochJobs, bytes_per_token: int, queued: np.ndarray) -> None:
        """`_check_job` for the queued jobs of a whole epoch, vectorised; the first bad job is named."""
        def first(bad: np.ndarray) -> int | None:
            hit = np.flatnonzero(queued & bad)
            return int(hit[0]) if hit.size else None

        if self.catalog.has_epoch(jobs.epoch):
            raise ValueError(_twice(make_job_id(jobs.epoch, 0)))
        if (k := first(self.states.known(jobs.epoch, len(jobs)))) is not None:
            raise ValueError(_twice(make_job_id(jobs.epoch, k)))
        if (k := first(jobs.bucket >= self.num_buckets)) is not None:
            raise ValueError(self._bad_bucket(make_job_id(jobs.epoch, k), int(jobs.bucket[k])))
        if (k := first(jobs.all_payload_bytes(bytes_per_token) > self.budget.capacity_bytes)) is not None:
            raise ValueError(self._too_big(make_job_id(jobs.epoch, k), jobs.payload_bytes(k, bytes_per_token)))

    def _bad_bucket(self, job_id: int, bucket: int) -> str:
        return (f"job {job_id} has bucket {bucket}, outside 0..{self.num_buckets - 1}: "
                "build the pool with num_buckets = len(data.bucket_boundaries)")

    def _too_big(self, job_id: int, est_bytes: int) -> str:
        return (f"job {job_id} needs ~{est_bytes} bytes, more than pool.capacity_bytes="
                f"{self.budget.capacity_bytes}: raise pool.capacity_bytes or lower data.tokens_per_job")


def _twice(job_id: int) -> str:
    return f"job {job_id} added twice: job ids must be unique across epochs"
