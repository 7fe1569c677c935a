"""The jobs and target answers the pool tests build (tests/test_pool*.py, test_pull_policy.py, test_stream.py)."""
from __future__ import annotations

from app.messages import ItemMeta, JobSpec


def job(i: int, bucket: int = 0, est: int = 100) -> JobSpec:
    """Job `i` of epoch 0: one sequence, 64 padded tokens, `est` bytes expected."""
    return JobSpec(job_id=i, epoch=0, index=i, bucket=bucket, seq_indices=(i,), padded_tokens=64, est_bytes=est)


def meta_for(j: JobSpec, target: int, nbytes: int | None = None) -> ItemMeta:
    """What `target` answers for `j`: 50 + bucket real tokens of 64, `nbytes` (default: the job's estimate)."""
    nb = j.est_bytes if nbytes is None else nbytes
    return ItemMeta(j.job_id, j.bucket, 1, 50 + j.bucket, 40, nb, target, 0.01)
