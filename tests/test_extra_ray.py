"""Extra GPUs on the tiny pipeline (topology.max_extra_gpus): the session's cluster has room beyond the
run's 2 targets / 2 drafters, an injected per-job delay makes the targets the short side, and one more
target joins mid-run in its own placement group; every job trained exactly once, counted from the step
log (not from the ledger the same code writes), and the new target really produced jobs."""
from __future__ import annotations

from pathlib import Path

import pytest

from app.run.outputs.timeline import read_timeline
from tests.e2e_helpers import run_drivers_together, summary, trained_counts

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# One epoch (34 jobs; the targets' run two, see DELAYS): the advice has its samples after ~12 jobs (6 steps
# a rank), holds 3 s, and the third target then serves the rest. max_rebalances=0: the split itself never moves, only the extra
# bundle changes it. A CPU topology's bundle counts as one against max_extra_gpus: at most one extra.
RUN = ["train.epochs=1", "eval.every_steps=0", "checkpoint.every_steps=20", "topology.rebalance=auto",
       "topology.rebalance_hold_s=3", "topology.max_rebalances=0", "topology.max_extra_gpus=1",
       "topology.num_targets=2", "topology.num_drafters=2"]


# The targets' run has two epochs: its third target must start (a process and a model load, however long
# the machine takes) and still find jobs, and the two others serve 3 s a job meanwhile, so two epochs give
# it over a minute of jobs left after the advice instead of ~30 s. The drafters' run needs no more: its
# jobs wait in the pool while the group is rebuilt, however long that takes.
DELAYS = {"targets": ["faults.target_delay_s=3.0", "train.epochs=2"], "drafters": ["faults.drafter_delay_s=2.5"]}


@pytest.fixture(scope="module")
def extra_runs(ray_cluster, tmp_path_factory) -> dict[str, tuple[Path, int, str]]:
    """Both runs at once, each its own driver process on the session's cluster (which has room for both
    runs' extra bundles): their length is mostly the injected delays (sleeps), which overlap instead of
    adding up. {short side: (run dir, exit code, output)}."""
    root = tmp_path_factory.mktemp("extra")
    runs = {short: (root / short, [*RUN, *delays]) for short, delays in DELAYS.items()}
    done = run_drivers_together(runs, timeout=1500)
    return {short: (runs[short][0], *done[short]) for short in DELAYS}


@pytest.mark.parametrize("short, new", [
    ("targets", [3, 2]),  # joins the pool, no checkpoint
    ("drafters", [2, 3]),  # the group rebuilt one rank larger from a checkpoint
])
def test_an_extra_bundle_goes_to_the_short_side_mid_run_and_each_job_is_trained_once(
        extra_runs, short: str, new: list[int]) -> None:
    from ray.util import placement_group_table

    tmp_path, code, out = extra_runs[short]
    assert code == 0, out[-3000:]
    s = summary(tmp_path)
    assert s["extra_gpus"] == 1 and s["extra_bundles"] == 1 and s["rebalances"] == 0, s.get("extra_history")
    rows = read_timeline(tmp_path)
    (asked,) = [r for r in rows if r["k"] == "extra"]
    (done,) = [r for r in rows if r["k"] == "extra_done"]
    assert asked["side"] == done["side"] == short and done["old"] == [2, 2] and done["new"] == new
    at = rows.index(done)
    if short == "targets":
        assert done["target_id"] == 2
        # The third target did jobs: the pool's own per-target counters at the end of the run.
        last_pool = [r for r in rows if r["k"] == "pool"][-1]
        assert int(last_pool["done_by_target"].get("2", 0)) > 0, last_pool["done_by_target"]
    else:
        assert done["checkpoint"]  # the rebuild resumed from the stop's checkpoint
        assert {r["rank"] for r in rows[at:] if r.get("k") == "step"} == {0, 1, 2}  # three ranks trained after
    counts = trained_counts(tmp_path)
    assert counts["trained_twice"] == 0 and counts["never_trained"] == 0, counts
    assert s["jobs_acked"] == s["jobs_scheduled"] and s["jobs_acked_twice"] == 0
    # The extra placement group went with the run's own.
    extra = [pg for pg in placement_group_table().values()
             if pg.get("name", "").startswith(f"dflash-{short}-") and pg["name"].endswith("-extra1")]
    assert extra and all(pg["state"] == "REMOVED" for pg in extra), extra
