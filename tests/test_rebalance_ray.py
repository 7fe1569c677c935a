"""An automatic re-split on the tiny pipeline (topology.rebalance=auto), with an injected per-job delay
that makes one side the short one: exactly one re-split, toward that side, and every job trained
exactly once, counted from the step log (not from the ledger the same code writes)."""
from __future__ import annotations

from pathlib import Path

import pytest

from app.bench.rebalance import resplits
from app.run.timeline import read_timeline
from tests.e2e_helpers import run_in_process, summary, trained_counts

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# Two epochs (68 jobs): the advice has its samples after ~20 jobs, the new split a long second half.
# The delays dominate the tiny model's compute (~0.3-0.6 s a micro-batch, ~0.2 s a forward on this loaded
# CPU), and make one side over 7x slower per actor, so the advised split is an end (7/1 or 1/7) whatever
# the load: after it there is nothing left to move, whichever way the rates drift.
RUN = ["train.epochs=2", "eval.every_steps=0", "checkpoint.every_steps=20", "topology.rebalance=auto",
       "topology.rebalance_hold_s=3"]


@pytest.mark.parametrize("short, delays", [
    ("targets", ["faults.target_delay_s=5.0"]),
    ("drafters", ["faults.drafter_delay_s=2.5"]),
])
def test_auto_resplit_moves_gpus_to_the_short_side_once_and_trains_each_job_once(
        ray_cluster, tmp_path: Path, short: str, delays: list[str]) -> None:
    assert run_in_process(tmp_path, *RUN, *delays) == 0
    s = summary(tmp_path)
    done = resplits(tmp_path)
    assert s["rebalances"] == 1 and len(done) == 1, s.get("rebalance_history")
    (old_t, old_d), (new_t, new_d) = done[0]["old"], done[0]["new"]
    assert (old_t, old_d) == (5, 3) and new_t + new_d == 8
    assert (new_t > old_t) if short == "targets" else (new_d > old_d)
    # The new group really ran at its size: rank ids of the step rows after the re-split.
    rows = read_timeline(tmp_path)
    at = next(i for i, r in enumerate(rows) if r.get("k") == "resplit_done")
    ranks_after = {r["rank"] for r in rows[at:] if r.get("k") == "step"}
    assert ranks_after == set(range(new_d))
    counts = trained_counts(tmp_path)
    assert counts["trained_twice"] == 0 and counts["never_trained"] == 0, counts
    assert s["jobs_acked"] == s["jobs_scheduled"] and s["jobs_acked_twice"] == 0
    kinds = [r["k"] for r in rows if r["k"].startswith("resplit")]
    assert kinds[:2] == ["resplit", "resplit_done"]
