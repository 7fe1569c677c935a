"""Real tiny runs: tau during the run and drafter-best/, the split advice at 1/7 and 7/1, the report."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.model.live_eval import read_best_meta
from app.run.outputs.report import PLOTS
from tests.e2e_helpers import run_in_process, summary

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_tau_during_the_run_best_drafter_and_report(ray_cluster, tmp_path: Path, capsys) -> None:
    # 6 epochs (~68 steps), an evaluation offered every 10 steps on tiny's eval prompts.
    assert run_in_process(tmp_path, "train.epochs=6", "eval.every_steps=10") == 0
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
    assert "tau " in capsys.readouterr().out


# The short side is short by construction: every job of it waits DELAY_S inside its measured time. A
# job is at most data.tokens_per_job=768 tokens, so that side makes at most 768 / 0.5 = 1536 tok/s per
# actor whatever the machine does; the other side, on tiny's CPU work, is several times faster.
DELAY_S = 0.5


@pytest.mark.parametrize("targets,drafters,slow", [(1, 7, "target"), (7, 1, "drafter")])
def test_split_advice_moves_gpus_to_the_short_side(ray_cluster, tmp_path: Path, targets, drafters, slow) -> None:
    from app.advise import main as advise_main

    assert run_in_process(tmp_path, f"topology.num_targets={targets}", f"topology.num_drafters={drafters}",
                          "eval.every_steps=0", f"faults.{slow}_delay_s={DELAY_S}") == 0
    advice = summary(tmp_path)["split_advice"]
    assert advice["current_targets"] == targets and advice["current_drafters"] == drafters
    assert advice[f"{slow}_tok_s"] <= 768 / DELAY_S  # the delay reached the measured rate
    assert advice["targets"] + advice["drafters"] == 8 and advice["gain"] > 0
    if slow == "target":
        assert advice["bound_now"] == "targets" and advice["targets"] > targets
    else:
        assert advice["bound_now"] == "drafters" and advice["drafters"] > drafters
    assert advise_main([str(tmp_path)]) == 0  # the same numbers from the run's timeline
