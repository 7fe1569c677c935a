"""Whose fault a raised forward is: the job's (a poison job) or the target's (a broken GPU).

A target whose CUDA context is poisoned (a sticky illegal memory access, a wedged driver) raises on
every job within milliseconds and frees its slot first, so it would take every re-tried job and
quarantine the dataset two strikes at a time. So the strikes are kept per (job, target):
- a target that raises `broken_after` times in a row (no job landed in between; distinct jobs
  whenever the pool had another to give it) is broken: it gets no more jobs, and the strikes it gave
  are taken back (its jobs are not charged). A new incarnation of it (`reset`) starts clean;
- a job is quarantined once it raised on two different targets, or, when no other target could
  take it, raised again on a target that has landed other jobs (a lone healthy target);
- a job that raised is re-tried first on a target that did not fail it yet (`may_take`), and on one
  that did only as a last resort (`last_resort`: every other known healthy target failed it too).
"""
from __future__ import annotations

from enum import Enum


class Verdict(str, Enum):
    RETRY = "retry"  # the job goes back, to be re-tried on another target first
    QUARANTINE = "quarantine"  # a poison job: set aside for good
    BROKEN = "broken"  # the target is broken; the job is not charged
    UNCHARGED = "uncharged"  # a late raise from a target already found broken


class Strikes:
    """Forward failures per job and target, raise streaks per target, and the broken targets."""

    def __init__(self, broken_after: int) -> None:
        assert broken_after >= 2, broken_after  # 1 would call a target broken for one poison job
        self.broken_after = broken_after
        self.failed_on: dict[int, set[int]] = {}  # job id -> targets its forward raised on (charged)
        self.broken: set[int] = set()
        self._streak: dict[int, list[int]] = {}  # target -> job ids it raised on since its last landing
        self._landed: set[int] = set()  # targets that landed a job in this incarnation
        self._known: set[int] = set()  # targets that asked for jobs and were not lost since

    def saw(self, target_id: int) -> None:
        """The target asked for a job: it is alive."""
        self._known.add(target_id)

    def may_take(self, job_id: int, target_id: int) -> bool:
        return target_id not in self.failed_on.get(job_id, ())

    def last_resort(self, job_id: int, target_id: int) -> bool:
        """No other live, healthy target could re-try the job: this one (which failed it) may."""
        return self._known - self.broken - {target_id} <= self.failed_on.get(job_id, set())

    def landed(self, target_id: int, job_id: int) -> None:
        self._streak.pop(target_id, None)
        self._landed.add(target_id)
        self.failed_on.pop(job_id, None)

    def raised(self, target_id: int, job_id: int) -> Verdict:
        if target_id in self.broken:
            return Verdict.UNCHARGED
        streak = self._streak.setdefault(target_id, [])
        streak.append(job_id)
        if len(streak) >= self.broken_after:
            self._mark_broken(target_id)
            return Verdict.BROKEN
        fails = self.failed_on.setdefault(job_id, set())
        again = target_id in fails
        fails.add(target_id)
        if len(fails) >= 2 or (again and target_id in self._landed):
            return Verdict.QUARANTINE
        return Verdict.RETRY

    def charged(self, job_id: int) -> bool:
        """The job has strikes: it waits among the re-tries, not at the queue's front."""
        return bool(self.failed_on.get(job_id))

    def forget(self, job_id: int) -> None:
        """The job is done with (quarantined, or acked by a rollback)."""
        self.failed_on.pop(job_id, None)

    def lost(self, target_id: int) -> None:
        """The target is gone: it takes part in no last-resort decision."""
        self._known.discard(target_id)

    def reset(self, target_id: int) -> None:
        """A new incarnation of the target (a restart): no streak, not broken, nothing landed yet."""
        self.broken.discard(target_id)
        self._streak.pop(target_id, None)
        self._landed.discard(target_id)

    def _mark_broken(self, target_id: int) -> None:
        self.broken.add(target_id)
        self._known.discard(target_id)
        for job_id in self._streak.pop(target_id):
            fails = self.failed_on.get(job_id)
            if fails is not None:
                fails.discard(target_id)
                if not fails:
                    del self.failed_on[job_id]
