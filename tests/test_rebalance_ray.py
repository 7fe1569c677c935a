"""An automatic re-split on the tiny pipeline (topology.rebalance=auto), with injected per-job delays that make
one side the short one: exactly one re-split, toward that side, and every job trained exactly once, counted from
the step log (not from the ledger the same code writes)."""
from __future__ import annotations

from pathlib import Path

import pytest

from app.bench.feeding.rebalance import resplits
from app.run.outputs.timeline import read_timeline
from tests.e2e_helpers import run_drivers_together, summary, trained_counts

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# Tiny on 2 targets / 2 drafters, two epochs (68 jobs). faults.virtual_clock: the advisor charges each side its
# injected delay, not its measured time, so the short side is short at any load (on this CPU box a drafter rank's
# own compute swings from 0.5 to 1.9 s a micro-batch with contention, a forward 0.2-1 s, and measured rates are
# what the box's scheduler made of them). At 10:1 the short side's 3 against the other's 1 gains +50% over 2/2,
# past min_gain 0.15; 3/1 and 1/3 are the ends: once there, nothing is left to move. The delays also bound how
# fast the run can go: the short side passes at most 4 jobs/s (beside the pool's 16 filled while the group
# starts), so the re-split (its samples after 12 jobs, held 3 s, a pool snapshot every 2 s) lands by job ~50 at
# the latest and the new split trains the rest (at load 50: jobs 34 and 20 of 68). That the advisor reads
# measured rates right is tested apart (tests/test_advice.py; tests/test_run_outputs_ray.py on live runs).
RUN = ["train.epochs=2", "eval.every_steps=0", "checkpoint.every_steps=20", "topology.rebalance=auto",
       "topology.rebalance_hold_s=3", "topology.num_targets=2", "topology.num_drafters=2", "faults.virtual_clock=true"]


DELAYS = {"targets": ["faults.target_delay_s=0.5", "faults.drafter_delay_s=0.05"],
          "drafters": ["faults.drafter_delay_s=0.5", "faults.target_delay_s=0.05"]}


@pytest.fixture(scope="module")
def resplit_runs(ray_cluster, tmp_path_factory) -> dict[str, tuple[Path, int, str]]:
    """Both runs at once, each its own driver process on the session's cluster: their length is mostly the
    injected delays (sleeps), which overlap instead of adding up. {short side: (run dir, exit code, output)}."""
    root = tmp_path_factory.mktemp("resplit")
    runs = {short: (root / short, [*RUN, *delays]) for short, delays in DELAYS.items()}
    done = run_drivers_together(runs, timeout=1500)
    return {short: (runs[short][0], *done[short]) for short in DELAYS}


@pytest.mark.parametrize("short", list(DELAYS))
def test_auto_resplit_moves_gpus_to_the_short_side_once_and_trains_each_job_once(resplit_runs, short: str) -> None:
    tmp_path, code, out = resplit_runs[short]
    assert code == 0, out[-3000:]
    s = summary(tmp_path)
    done = resplits(tmp_path)
    assert s["rebalances"] == 1 and len(done) == 1, s.get("rebalance_history")
    (old_t, old_d), (new_t, new_d) = done[0]["old"], done[0]["new"]
    assert (old_t, old_d) == (2, 2) and new_t + new_d == 4
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
