"""Real tiny runs: tau during the run and drafter-best/, the split advice at 1/7 and 7/1, the report."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.model.drafter_tau import read_best_meta
from app.run.outputs.report_page import PLOTS
from tests.e2e_helpers import assert_finished, run_drivers_together, summary

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_tau_during_the_run_best_drafter_and_report(reference_run) -> None:
    # The session's reference run: 6 epochs (~68 steps), an evaluation offered every 10 steps on tiny's eval prompts.
    assert_finished(reference_run)
    tmp_path = reference_run.run_dir
    s = summary(tmp_path)
    hist = s["tau_history"]
    assert len(hist) >= 3 and [st for st, _ in hist] == sorted(st for st, _ in hist)
    assert hist[-1][0] == s["steps"] and hist[-1][1] == pytest.approx(s["tau_trained"])  # drafter/, as app.evaluate
    assert hist[-1][1] > hist[0][1]  # it learned between the first and the last evaluation
    assert s["tau_matches_greedy"] is True
    best = max(t for _, t in hist)
    assert s["tau_best"]["tau"] == best and read_best_meta(tmp_path / "drafter-best")["tau"] == best
    rows = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["k"] == "eval"] == [st for st, _ in hist]
    page = (tmp_path / "report.html").read_text()
    assert all(f'id="plot-{p}"' in page for p in PLOTS)
    assert "tau " in reference_run.out


# The short side is short by construction: every job of it waits DELAY_S inside its measured time. A
# job is at most data.tokens_per_job=768 tokens, so that side makes at most 768 / 0.5 = 1536 tok/s per
# actor whatever the machine does; the other side, on tiny's CPU work, is several times faster.
DELAY_S = 0.5


# The slow side: (targets, drafters). Eight bundles: at 1/3 and 3/1 the fast side was not fast enough on a loaded
# box for a move to pay (1/3 advised keep at +1%); seven of the fast side keep the margin whatever the load.
SPLITS = {"target": (1, 7), "drafter": (7, 1)}


@pytest.fixture(scope="module")
def split_runs(ray_cluster, tmp_path_factory) -> dict[str, tuple[Path, int, str]]:
    """Both runs at once, each its own driver process on the session's cluster: the slow side of each waits
    DELAY_S a job, and the waits overlap instead of adding up. One epoch: the advice is read from the
    rates of 34 jobs, which the delay fixes whatever the machine. {slow side: (run dir, exit code, output)}."""
    root = tmp_path_factory.mktemp("split")
    runs = {slow: (root / slow, [f"topology.num_targets={t}", f"topology.num_drafters={d}", "train.epochs=1",
                                 "eval.every_steps=0", f"faults.{slow}_delay_s={DELAY_S}"])
            for slow, (t, d) in SPLITS.items()}
    done = run_drivers_together(runs, timeout=1500)
    return {slow: (runs[slow][0], *done[slow]) for slow in SPLITS}


@pytest.mark.parametrize("slow", list(SPLITS))
def test_split_advice_moves_gpus_to_the_short_side(split_runs, slow: str) -> None:
    from app.advise import main as advise_main

    targets, drafters = SPLITS[slow]
    tmp_path, code, out = split_runs[slow]
    assert code == 0, out[-3000:]
    advice = summary(tmp_path)["split_advice"]
    assert advice["current_targets"] == targets and advice["current_drafters"] == drafters
    assert advice[f"{slow}_tok_s"] <= 768 / DELAY_S  # the delay reached the measured rate
    assert advice["targets"] + advice["drafters"] == targets + drafters and advice["gain"] > 0
    if slow == "target":
        assert advice["bound_now"] == "targets" and advice["targets"] > targets
    else:
        assert advice["bound_now"] == "drafters" and advice["drafters"] > drafters
    assert advise_main([str(tmp_path)]) == 0  # the same numbers from the run's timeline
