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
from collections.abc import Sequence

import numpy as np

from app.config.schema import DataConfig
from app.messages import JobSpec, make_job_id

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


def build_schedule(
    dataset_lengths: np.ndarray, data: DataConfig, epoch: int, est_bytes_per_token: int = 0
) -> list[JobSpec]:
    """Every job of `epoch`, in schedule order; job k has index k and id make_job_id(epoch, k)."""
    lengths = np.asarray(dataset_lengths, dtype=np.int64)
    per_bucket = bucket_jobs(lengths, data, epoch)
    # Per-epoch tie-break between buckets, so epochs also differ in how buckets interleave.
    priority = _rng(data.seed, epoch, len(per_bucket)).permutation(len(per_bucket))
    order = interleave([len(j) for j in per_bucket], priority.tolist())
    specs = []
    for index, (b, i) in enumerate(order):
        seqs = tuple(per_bucket[b][i])
        padded = int(lengths[list(seqs)].max()) * len(seqs)
        specs.append(
            JobSpec(
                job_id=make_job_id(epoch, index),
                epoch=epoch,
                index=index,
                bucket=b,
                seq_indices=seqs,
                padded_tokens=padded,
                est_bytes=padded * est_bytes_per_token,
            )
        )
    return specs


def schedule_summary(
    dataset_lengths: np.ndarray, data: DataConfig, epochs: int, schedules: list[list[JobSpec]] | None = None
) -> dict:
    """Per-bucket sequences and tokens, and per-epoch job counts and padding, for `app.prepare`.

    `schedules` (one list of JobSpec per epoch) saves rebuilding them when the caller has them.
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
        specs = schedules[epoch] if schedules is not None else build_schedule(lengths, data, epoch)
        padded = sum(s.padded_tokens for s in specs)
        jobs_per_bucket = [0] * len(data.bucket_boundaries)
        for s in specs:
            jobs_per_bucket[s.bucket] += 1
        per_epoch.append(
            {
                "epoch": epoch,
                "jobs": len(specs),
                "jobs_per_bucket": jobs_per_bucket,
                "padded_tokens": int(padded),
                "padding_efficiency": round(float(lengths.sum()) / padded, 6) if padded else 0.0,
            }
        )
    for b, row in enumerate(per_bucket):
        row["jobs_per_epoch"] = per_epoch[0]["jobs_per_bucket"][b] if per_epoch else 0
    return {"buckets": per_bucket, "epochs": per_epoch, "jobs_per_epoch": [e["jobs"] for e in per_epoch]}
