"""Buckets, jobs and the linear interleaved schedule: a pure function of (lengths, config, epoch).

Per epoch and bucket, a generator seeded from (data.seed, epoch, bucket) shuffles the bucket's
sequences; shuffled runs of a few jobs' worth are sorted by length before packing (so a job pads
little) and the bucket's jobs are shuffled again. Then each bucket's jobs are spread evenly over the
epoch (`interleave`: every prefix of the schedule holds each bucket's share to within one job, so
every window of K consecutive jobs holds at least floor(K * share) - 1 of each bucket; plain
"merge by fractional position (i + o_b) / n_b" misses that bound by one with several buckets). Nothing depends on process state, so a
resumed run rebuilds exactly the same jobs from (seed, epoch).
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from app.config.schema import DataConfig
from app.messages import JobSpec, make_job_id, split_job_id

# Sequences sorted together before packing, in units of one job's worth of sequences.
SORT_WINDOW_JOBS = 8


def assign_bucket(length: int, boundaries: Sequence[int]) -> int:
    """Bucket i holds lengths in (boundaries[i-1], boundaries[i]]; longer than the last: last bucket."""
    return min(bisect.bisect_left(boundaries, length), len(boundaries) - 1)


def assign_buckets(lengths: np.ndarray, boundaries: Sequence[int]) -> np.ndarray:
    """Vectorised assign_bucket."""
    b = np.searchsorted(np.asarray(boundaries), np.asarray(lengths), side="left")
    return np.minimum(b, len(boundaries) - 1).astype(np.int64)


def _rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    # PCG64 from an explicit SeedSequence: identical across processes, platforms and numpy versions.
    return np.random.default_rng(np.random.SeedSequence([seed, epoch, stream]))


def pack_jobs(seq_ids: np.ndarray, lengths: np.ndarray, tokens_per_job: int) -> list[list[int]]:
    """Greedy packing in the given order: a job grows while longest x count <= tokens_per_job.

    A sequence longer than tokens_per_job forms a job of its own.
    """
    jobs: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in seq_ids.tolist():
        n = int(lengths[i])
        if cur and max(longest, n) * (len(cur) + 1) > tokens_per_job:
            jobs.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        jobs.append(cur)
    return jobs


def bucket_jobs(lengths: np.ndarray, data: DataConfig, epoch: int) -> list[list[list[int]]]:
    """Per bucket, its jobs (lists of sequence indices) for `epoch`, in the bucket's epoch order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    buckets = assign_buckets(lengths, data.bucket_boundaries)
    out: list[list[list[int]]] = []
    for b in range(len(data.bucket_boundaries)):
        rng = _rng(data.seed, epoch, b)
        ids = np.flatnonzero(buckets == b)
        if len(ids) == 0:
            out.append([])
            continue
        ids = ids[rng.permutation(len(ids))]
        per_job = max(1, data.tokens_per_job // max(1, int(lengths[ids].max())))
        window = per_job * SORT_WINDOW_JOBS
        jobs: list[list[int]] = []
        for lo in range(0, len(ids), window):
            chunk = ids[lo : lo + window]
            chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
            jobs.extend(pack_jobs(chunk, lengths, data.tokens_per_job))
        out.append([jobs[j] for j in rng.permutation(len(jobs))])
    return out


def interleave(counts: Sequence[int], priority: Sequence[int]) -> list[tuple[int, int]]:
    """(bucket, i) for every job: a sequence whose prefix counts stay within 1 of share x length.

    Steiner-Yeomans just-in-time sequencing: with N jobs in all and n_b in bucket b, the j-th job
    (1-based) of bucket b gets the slot window [ceil((j - D) N / n_b), floor((j - 1 + D) N / n_b) + 1]
    for D = 1 - 1/(2N) < 1, and earliest-deadline-first fills slots 1..N (ties: lower `priority`).
    Every prefix of length t then holds t * n_b / N +- D jobs of bucket b, hence every window of K
    jobs at least K * share - 2D > K * share - 2 of them: floor(K * share) - 1 or more.
    """
    n_total = sum(counts)
    nxt = [0] * len(counts)  # jobs of each bucket already placed

    def window(b: int) -> tuple[int, int]:
        j, n = nxt[b] + 1, counts[b]
        # Integer forms of the two bounds with D = 1 - 1/(2N).
        release = -(-((j - 1) * 2 * n_total + 1) // (2 * n))
        deadline = (2 * j * n_total - 1) // (2 * n) + 1
        return release, deadline

    order: list[tuple[int, int]] = []
    for t in range(1, n_total + 1):
        live = [b for b in range(len(counts)) if nxt[b] < counts[b]]
        wins = {b: window(b) for b in live}
        ready = [b for b in live if wins[b][0] <= t]
        if ready:
            b = min(ready, key=lambda c: (wins[c][1], priority[c]))
        else:  # cannot happen for a feasible D; kept so the order always covers every job
            b = min(live, key=lambda c: (wins[c][0], priority[c]))
        order.append((b, nxt[b]))
        nxt[b] += 1
    return order


LENGTH_BYTES = 8  # HiddenBatch.lengths_B is int64, one entry per sequence


@dataclass(frozen=True)
class EpochJobs:
    """One epoch's jobs as flat arrays (about 13 bytes per job plus 4 per sequence; 8 more with costs):
    job k of the epoch is bucket[k], holds seq_ids[starts[k]:starts[k+1]], pads to padded[k] tokens and
    costs the drafter cost[k] query rows. JobSpecs are made from it on demand, so no process holds a
    JobSpec for every job of every epoch. It is also the pool's message (`HSPool.add_epoch`): put once in
    the object store, its arrays reach the pool zero-copy."""

    epoch: int
    bucket: np.ndarray  # uint8 [J]
    padded: np.ndarray  # int32 [J]: longest sequence x number of sequences
    starts: np.ndarray  # int64 [J+1]
    seq_ids: np.ndarray  # int32 [sequences of the epoch]
    cost: np.ndarray | None = None  # int64 [J]: drafter query rows (`with_costs`); None = unknown (0)

    def __len__(self) -> int:
        return len(self.bucket)

    def spec(self, index: int, est_bytes_per_token: int = 0) -> JobSpec:
        """Job `index` of the epoch; its id is make_job_id(epoch, index)."""
        padded = int(self.padded[index])
        return JobSpec(
            job_id=make_job_id(self.epoch, index), epoch=self.epoch, index=index, bucket=int(self.bucket[index]),
            seq_indices=tuple(self.seq_ids[self.starts[index]:self.starts[index + 1]].tolist()),
            padded_tokens=padded, est_bytes=self.payload_bytes(index, est_bytes_per_token),
            cost=0 if self.cost is None else int(self.cost[index]),
        )

    def with_costs(self, seq_rows: np.ndarray) -> "EpochJobs":
        """The same jobs with `cost` = the sum of their sequences' query rows (`app.data.costs.sequence_rows`),
        what `app.data.costs.with_costs` gives their JobSpecs."""
        rows = np.asarray(seq_rows, dtype=np.int64)[self.seq_ids]
        cost = np.add.reduceat(rows, self.starts[:-1]) if len(self) else np.zeros(0, np.int64)
        return replace(self, cost=cost.astype(np.int64))

    def payload_bytes(self, index: int, bytes_per_token: int) -> int:
        """Exact size of job `index`'s payload: per padded token (hidden states, ids, mask) plus the
        int64 `lengths_B` entry of each sequence (`HiddenBatch`; 0 while the device is unknown)."""
        if not bytes_per_token:
            return 0
        return int(self.padded[index]) * bytes_per_token + LENGTH_BYTES * int(self.starts[index + 1] - self.starts[index])

    def all_payload_bytes(self, bytes_per_token: int) -> np.ndarray:
        """payload_bytes of every job, int64 [J] (a temporary: 8 bytes per job)."""
        if not bytes_per_token:
            return np.zeros(len(self), np.int64)
        return self.padded.astype(np.int64) * bytes_per_token + LENGTH_BYTES * np.diff(self.starts)

    def max_payload_bytes(self, bytes_per_token: int) -> int:
        """The largest payload_bytes of the epoch (0 for an empty epoch or an unknown device)."""
        return int(self.all_payload_bytes(bytes_per_token).max(initial=0))

    def specs(self, lo: int = 0, hi: int | None = None, est_bytes_per_token: int = 0) -> list[JobSpec]:
        return [self.spec(k, est_bytes_per_token) for k in range(lo, len(self) if hi is None else hi)]

    @property
    def nbytes(self) -> int:
        arrays = (self.bucket, self.padded, self.starts, self.seq_ids) + (() if self.cost is None else (self.cost,))
        return sum(a.nbytes for a in arrays)


def epoch_jobs(dataset_lengths: np.ndarray, data: DataConfig, epoch: int) -> EpochJobs:
    """Every job of `epoch`, in schedule order, as compact arrays (a pure function of lengths, data, epoch)."""
    lengths = np.asarray(dataset_lengths, dtype=np.int64)
    per_bucket = bucket_jobs(lengths, data, epoch)
    # Per-epoch tie-break between buckets, so epochs also differ in how buckets interleave.
    priority = _rng(data.seed, epoch, len(per_bucket)).permutation(len(per_bucket))
    order = interleave([len(j) for j in per_bucket], priority.tolist())
    assert len(per_bucket) <= 256  # buckets fit uint8
    jobs = [per_bucket[b][i] for b, i in order]
    sizes = np.fromiter((len(j) for j in jobs), dtype=np.int64, count=len(jobs))
    starts = np.zeros(len(jobs) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    seq_ids = np.fromiter((i for j in jobs for i in j), dtype=np.int32, count=int(starts[-1]))
    longest = np.maximum.reduceat(lengths[seq_ids], starts[:-1]) if len(jobs) else np.zeros(0, np.int64)
    return EpochJobs(epoch=epoch, bucket=np.fromiter((b for b, _ in order), dtype=np.uint8, count=len(order)),
                     padded=(longest * sizes).astype(np.int32), starts=starts, seq_ids=seq_ids)


def build_schedule(
    dataset_lengths: np.ndarray, data: DataConfig, epoch: int, est_bytes_per_token: int = 0
) -> list[JobSpec]:
    """Every job of `epoch`, in schedule order; job k has index k and id make_job_id(epoch, k)."""
    return epoch_jobs(dataset_lengths, data, epoch).specs(est_bytes_per_token=est_bytes_per_token)


class ScheduledJobs(Sequence):
    """Every job of the run (all epochs, in order) as a sequence of JobSpecs made on demand from each
    epoch's `EpochJobs`; indexing and slicing work as on a list. `est_bytes_per_token` sizes the
    JobSpecs it makes (set once the device is known)."""

    def __init__(self, epochs: list[EpochJobs], est_bytes_per_token: int = 0) -> None:
        self.epochs = epochs
        self.est_bytes_per_token = est_bytes_per_token
        self._ends = np.cumsum([len(e) for e in epochs], dtype=np.int64)

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getitem__(self, item):
        if isinstance(item, slice):
            return [self[k] for k in range(*item.indices(len(self)))]
        k = item + len(self) if item < 0 else item
        if not 0 <= k < len(self):
            raise IndexError(item)
        e = int(np.searchsorted(self._ends, k, side="right"))
        return self.epochs[e].spec(k - (int(self._ends[e - 1]) if e else 0), self.est_bytes_per_token)

    def __iter__(self):
        for e in self.epochs:
            for k in range(len(e)):
                yield e.spec(k, self.est_bytes_per_token)

    def scheduled_only(self, ids: Iterable[int]) -> list[int]:
        """The ids among `ids` that name a job of this schedule, in their order. A checkpoint of a run
        with more epochs (train.epochs lowered on resume) holds ids this schedule has no job for: they
        must not count as done jobs here, nor reach the pool's ledger."""
        ends = [len(e) for e in self.epochs]
        return [j for j in ids if (ek := split_job_id(j))[0] < len(ends) and ek[1] < ends[ek[0]]]

    def max_payload_bytes(self) -> int:
        """The largest job's exact payload size at `est_bytes_per_token` (its JobSpec.est_bytes)."""
        return max((e.max_payload_bytes(self.est_bytes_per_token) for e in self.epochs), default=0)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.epochs)


def schedule_summary(
    dataset_lengths: np.ndarray, data: DataConfig, epochs: int, schedules: list[EpochJobs] | None = None
) -> dict:
    """Per-bucket sequences and tokens, and per-epoch job counts and padding, for `app.prepare`.

    `schedules` (one EpochJobs per epoch) saves rebuilding them when the caller has them.
    """
    lengths = np.asarray(dataset_lengths, dtype=np.int64)
    buckets = assign_buckets(lengths, data.bucket_boundaries) if len(lengths) else np.zeros(0, np.int64)
    per_bucket = []
    for b, hi in enumerate(data.bucket_boundaries):
        sel = lengths[buckets == b]
        per_bucket.append(
            {
                "bucket": b,
                "max_length": int(hi),
                "sequences": int(len(sel)),
                "tokens": int(sel.sum()),
            }
        )
    per_epoch = []
    for epoch in range(epochs):
        jobs = schedules[epoch] if schedules is not None else epoch_jobs(lengths, data, epoch)
        padded = int(jobs.padded.sum(dtype=np.int64))
        per_epoch.append(
            {
                "epoch": epoch,
                "jobs": len(jobs),
                "jobs_per_bucket": np.bincount(jobs.bucket, minlength=len(data.bucket_boundaries)).tolist(),
                "padded_tokens": padded,
                "padding_efficiency": round(float(lengths.sum()) / padded, 6) if padded else 0.0,
            }
        )
    for b, row in enumerate(per_bucket):
        row["jobs_per_epoch"] = per_epoch[0]["jobs_per_bucket"][b] if per_epoch else 0
    return {"buckets": per_bucket, "epochs": per_epoch, "jobs_per_epoch": [e["jobs"] for e in per_epoch]}
