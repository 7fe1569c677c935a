"""Jobs entering the pool: whole epochs (`add_epoch`, the run's path) or JobSpec lists (`add_jobs`,
tests and benches), checked, with the ids of a restored ledger skipped. The errors name the bad job
and the fix: jobs come from the driver's schedule, so they mean a caller built them wrong."""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from app.data.schedule import EpochJobs
from app.messages import JobSpec, make_job_id
from app.pool.book import JobQueue
from app.pool.records import JobCatalog, JobState, JobStates, Ledger


class Intake:
    """Adds jobs to the queue and job states (returning how many per bucket), restores a ledger,
    and refuses jobs after `finish`: unique ids, a bucket the pool has, a payload that fits."""

    def __init__(self, num_buckets: int, capacity_bytes: int, queue: JobQueue, states: JobStates,
                 catalog: JobCatalog, ledger: Ledger) -> None:
        self.num_buckets = num_buckets
        self.capacity_bytes = capacity_bytes
        self.finished = False  # no more jobs will be added
        self._queue, self._states, self._catalog, self._ledger = queue, states, catalog, ledger

    def add_jobs(self, jobs: Iterable[JobSpec]) -> list[int]:
        self._refuse_after_finish("add_jobs")
        added = [0] * self.num_buckets
        for job in jobs:
            if job.job_id in self._ledger:
                continue
            self._check_job(job)
            self._states.move(job.job_id, JobState.PENDING)
            self._queue.append(job)
            added[job.bucket] += 1
        return added

    def add_epoch(self, jobs: EpochJobs, bytes_per_token: int) -> list[int]:
        self._refuse_after_finish("add_epoch")
        skipped = self._ledger.mask(jobs.epoch, len(jobs))
        queued = ~skipped
        self._check_epoch(jobs, bytes_per_token, queued)
        self._states.add_epoch(jobs.epoch, queued)
        self._queue.append_epoch(jobs, bytes_per_token, skipped)
        return np.bincount(jobs.bucket[queued], minlength=self.num_buckets).tolist()

    def restore(self, acked_ids: Iterable[int]) -> None:
        """Jobs acked by a previous run (from a checkpoint) join the ledger and leave the queue."""
        ids = set(acked_ids)
        for jid in ids:
            if jid not in self._ledger:
                self._states.move(jid, JobState.ACKED)
                self._ledger.add(jid)
        self._queue.remove(ids)

    def _refuse_after_finish(self, call: str) -> None:
        if self.finished:
            raise ValueError(f"{call} after finish_adding: add every job of the run first")

    def _check_job(self, job: JobSpec) -> None:
        if job.job_id in self._states:
            raise ValueError(_twice(job.job_id))
        if not 0 <= job.bucket < self.num_buckets:
            raise ValueError(self._bad_bucket(job.job_id, job.bucket))
        if job.est_bytes > self.capacity_bytes:
            raise ValueError(self._too_big(job.job_id, job.est_bytes))

    def _check_epoch(self, jobs: EpochJobs, bytes_per_token: int, queued: np.ndarray) -> None:
        """`_check_job` for the queued jobs of a whole epoch, vectorised; the first bad job is named."""
        def first(bad: np.ndarray) -> int | None:
            hit = np.flatnonzero(queued & bad)
            return int(hit[0]) if hit.size else None

        if self._catalog.has_epoch(jobs.epoch):
            raise ValueError(_twice(make_job_id(jobs.epoch, 0)))
        if (k := first(self._states.known(jobs.epoch, len(jobs)))) is not None:
            raise ValueError(_twice(make_job_id(jobs.epoch, k)))
        if (k := first(jobs.bucket >= self.num_buckets)) is not None:
            raise ValueError(self._bad_bucket(make_job_id(jobs.epoch, k), int(jobs.bucket[k])))
        if (k := first(jobs.all_payload_bytes(bytes_per_token) > self.capacity_bytes)) is not None:
            raise ValueError(self._too_big(make_job_id(jobs.epoch, k), jobs.payload_bytes(k, bytes_per_token)))

    def _bad_bucket(self, job_id: int, bucket: int) -> str:
        return (f"job {job_id} has bucket {bucket}, outside 0..{self.num_buckets - 1}: "
                "build the pool with num_buckets = len(data.bucket_boundaries)")

    def _too_big(self, job_id: int, est_bytes: int) -> str:
        return (f"job {job_id} needs ~{est_bytes} bytes, more than pool.capacity_bytes="
                f"{self.capacity_bytes}: raise pool.capacity_bytes or lower data.tokens_per_job")


def _twice(job_id: int) -> str:
    return f"job {job_id} added twice: job ids must be unique across epochs"
