"""Jobs on targets: which target runs each, since when, and the bytes reserved for its payload."""
from __future__ import annotations

from dataclasses import dataclass

from app.messages import JobSpec


@dataclass
class InFlightJob:
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
