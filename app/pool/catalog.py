"""Every job the pool was given, kept compactly: JobSpecs are made when asked for, not stored.

The run adds whole epochs (`EpochJobs`, whose arrays arrive zero-copy from the object store, so they
are not pool heap); tests and benches may add single JobSpecs, which are kept as given. A job id is
"added" when it was queued: an epoch's jobs acked in a restored ledger when the epoch arrived were
skipped, so they are not (a rollback never re-queues them, as before).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from app.data.schedule import EpochJobs
from app.messages import JobSpec, split_job_id


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
