"""Replay on the tiny config through the real driver (issue 38 part 2): epoch 2 is served from the store, and a
repeated run reads every job from it, counted from the targets' own counters and the step log."""
from __future__ import annotations

from pathlib import Path

import pytest

from app.messages import split_job_id
from app.replay.target_side import read_counts
from tests.e2e_helpers import run_in_process, summary, trained_counts

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# One target: jobs reach it in schedule order, so every epoch-1 job finds its sequences written (with
# several targets an epoch-2 job may run while an epoch-1 job holding one of its sequences is still on another).
ONE_TO_ONE = ["topology.num_targets=1", "topology.num_drafters=1", "train.epochs=2", "eval.every_steps=0"]


def _epoch_jobs(run_dir: Path) -> dict[int, int]:
    """Jobs trained per epoch, from the step log (what the ranks reported), not from any replay counter."""
    import json

    seen: dict[int, set] = {}
    for line in (run_dir / "steps.jsonl").read_text().splitlines():
        for job in json.loads(line).get("job_ids", []):
            seen.setdefault(split_job_id(job)[0], set()).add(job)
    return {e: len(ids) for e, ids in sorted(seen.items())}


def test_epoch_two_and_a_repeated_run_are_served_from_replay(ray_cluster, tmp_path: Path) -> None:
    """Run 1: epoch 1's jobs forwarded, epoch 2's (the same sequences regrouped) all replayed; run 2 (same
    seed, a fresh checkpoint folder, the same store): no forward at all. Both train (tau above untrained).
    Two Ray runs of one seed differ in their step mix whatever the features (measured: three runs, three
    different weights), so equal tau is shown in one process instead (test_replay.py)."""
    store = f"pool.replay={tmp_path / 'replay'}"
    first, again = tmp_path / "first", tmp_path / "again"
    assert run_in_process(first, *ONE_TO_ONE, store) == 0
    per_epoch = _epoch_jobs(first)
    s = summary(first)
    assert trained_counts(first) == {"trained_once": s["jobs_scheduled"], "trained_twice": 0, "never_trained": 0}
    assert sum(per_epoch.values()) == s["jobs_scheduled"] and set(per_epoch) == {0, 1}
    counts = read_counts(str(first))
    assert (counts.forwards, counts.replay_hits) == (per_epoch[0], per_epoch[1])

    assert run_in_process(again, *ONE_TO_ONE, store) == 0
    counts = read_counts(str(again))
    assert (counts.forwards, counts.replay_hits) == (0, s["jobs_scheduled"])
    assert trained_counts(again) == trained_counts(first)
    for run in (first, again):
        assert summary(run)["tau_trained"] > summary(run)["tau_untrained"]
