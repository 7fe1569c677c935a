"""Extra GPUs on the tiny pipeline (topology.max_extra_gpus): the session's cluster has room beyond the
run's 2 targets / 2 drafters, an injected per-job delay makes the targets the short side, and one more
target joins mid-run in its own placement group; every job trained exactly once, counted from the step
log (not from the ledger the same code writes), and the new target really produced jobs."""
from __future__ import annotations

from pathlib import Path

import pytest

from app.run.timeline import read_timeline
from tests.e2e_helpers import run_in_process, summary, trained_counts

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# One epoch (34 jobs): the advice has its samples after ~12 jobs (6 steps a rank), holds 3 s, and the
# third target then serves the rest. max_rebalances=0: the split itself never moves, only the extra
# bundle changes it. A CPU topology's bundle counts as one against max_extra_gpus: at most one extra.
RUN = ["train.epochs=1", "eval.every_steps=0", "checkpoint.every_steps=20", "topology.rebalance=auto",
       "topology.rebalance_hold_s=3", "topology.max_rebalances=0", "topology.max_extra_gpus=1",
       "topology.num_targets=2", "topology.num_drafters=2", "faults.target_delay_s=3.0"]


def test_an_extra_target_joins_mid_run_on_free_room_and_each_job_is_trained_once(
        ray_cluster, tmp_path: Path) -> None:
    assert run_in_process(tmp_path, *RUN) == 0
    s = summary(tmp_path)
    assert s["extra_gpus"] == 1 and s["extra_bundles"] == 1 and s["rebalances"] == 0, s.get("extra_history")
    rows = read_timeline(tmp_path)
    (asked,) = [r for r in rows if r["k"] == "extra"]
    (done,) = [r for r in rows if r["k"] == "extra_done"]
    assert asked["side"] == done["side"] == "targets" and done["old"] == [2, 2] and done["new"] == [3, 2]
    assert done["target_id"] == 2
    # The third target did jobs: the pool's own per-target counters at the end of the run.
    last_pool = [r for r in rows if r["k"] == "pool"][-1]
    assert int(last_pool["done_by_target"].get("2", 0)) > 0, last_pool["done_by_target"]
    counts = trained_counts(tmp_path)
    assert counts["trained_twice"] == 0 and counts["never_trained"] == 0, counts
    assert s["jobs_acked"] == s["jobs_scheduled"] and s["jobs_acked_twice"] == 0
