"""What a pool snapshot (`PoolStats`, app/pool/telemetry.py) means to supervision, as pure code: the policy's
periodic `Tick`, the target failures and quarantined jobs not seen before, and the ledger's counts for
summary.json. `PoolWatch` remembers what it has reported; the supervisor (app/run/supervisor.py) reads
the snapshot each loop turn and feeds what this says to the policy.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from app.run.supervise.events import RankProgress, TargetFailed, Tick


class PoolWatch:
    """The pool's failures and quarantines reported once each, and the tick of a snapshot."""

    def __init__(self, min_ready: int) -> None:
        self.min_ready = min_ready  # pool.min_ready: buffered items that make a pull servable
        self.seen_failures = 0  # target failures of the current pool already reported
        self.quarantined_seen: set[int] = set()

    def new_pool(self) -> None:
        """A recreated pool's failure list starts empty (its quarantines stay reported)."""
        self.seen_failures = 0

    def new_failures(self, stats) -> Iterator[TargetFailed]:
        """The target failures the pool listed since the last look, each counted as seen when handed out."""
        for failure in stats.target_failures[self.seen_failures:]:
            self.seen_failures += 1
            yield TargetFailed(failure.target_id, str(failure))

    def new_quarantined(self, stats) -> list[tuple[int, str]]:
        """(job id, error) of the poison jobs the pool set aside since the last look, in job order."""
        fresh = [(jid, error) for jid, error in sorted(stats.quarantined.items()) if jid not in self.quarantined_seen]
        self.quarantined_seen.update(jid for jid, _ in fresh)
        return fresh

    def tick(self, stats, steps: int, ranks: tuple[RankProgress, ...]) -> Tick:
        """The policy's periodic look: `steps` the group's highest step seen, `ranks` their progress."""
        # Servable: a pull could be served now; prefetched leases alone are not "data waiting".
        servable = stats.buffered >= self.min_ready or (stats.producing_finished and stats.buffered > 0)
        return Tick(dict(stats.oldest_in_flight_age_s), servable, steps, ranks,
                    quarantined=len(stats.quarantined), total_jobs=stats.total_jobs)


def ledger_report(stats) -> dict[str, Any]:
    """The ledger's counts for summary.json, from the pool's last snapshot."""
    return {"jobs_acked": stats.acked, "jobs_acked_twice": stats.acked_twice, "jobs_total": stats.total_jobs,
            "jobs_quarantined": len(stats.quarantined),
            "quarantined_jobs": [{"job_id": j, "error": e} for j, e in sorted(stats.quarantined.items())]}
