"""The learning checks reach where a user looks (no Ray): the status line, the log lines, wandb's step row,
summary.json, the gauges' payload and report.html, each from one evaluation's `TauMeasurement.health` dict."""
from __future__ import annotations

from dataclasses import replace

from app.config.health_section import HealthConfig
from app.model.health import Health, status_word, verdicts
from app.run.evaluate.schedule import TauBook, health_gauges, health_line
from app.run.outputs.monitor import RunMonitor
from app.run.outputs.report_page import render
from app.run.outputs.wandb_rows import TauRows, health_keys

STUCK = Health(step=200, tau=1.02, tau_fit=1.03, tau_replay=1.02, tau_no_features=1.01, tau_layers_below=1.0,
               tau_layers_above=1.02, head_is_target=True, first_distinct=1, first_top_share=1.0, target_top_share=0.05,
               anchor_changed=0.0, pos1=0.01, anchors=300, seconds=0.4)


def _health(h: Health) -> dict:
    """What evaluate_drafter puts in TauMeasurement.health (app/model/drafter_tau.py check_health)."""
    found = verdicts(h, HealthConfig())
    return {**h.to_dict(), "verdicts": [v.line for v in found], "names": [v.name for v in found],
            "status": status_word(found)}


def test_the_status_line_says_the_newest_evaluations_word():
    mon = RunMonitor()
    assert "health" not in mon.line()  # no evaluation yet: nothing to say
    mon.add_health(100, _health(replace(STUCK, step=100)))
    mon.add_tau(100, 1.02)
    mon.add_health(200, _health(replace(STUCK, tau=4.0, tau_fit=4.2, tau_replay=4.0, first_distinct=40,
                                        first_top_share=0.05, pos1=0.9, tau_no_features=1.1)))
    mon.add_tau(200, 4.0)
    assert mon.values()["health"] == "ok" and "tau 4.00 (best 4.00 @200) health ok |" in mon.line()
    mon.add_health(300, _health(replace(STUCK, step=300)))
    assert mon.values()["health"] == "not_fitting+3"


def test_summary_wandb_gauges_and_log_line_carry_the_figures():
    health = _health(STUCK)
    book = TauBook()
    book.record({"step": 100, "tau": 1.5, "per_pos_accept": [0.3], "matches_greedy": True})  # a resumed one: no checks
    book.record({"step": 200, "tau": 1.02, "per_pos_accept": [0.0], "matches_greedy": True, "health": health})
    summary = book.summary()
    assert summary["health_history"] == [[200, 1.03, 1.02]] and summary["health"]["status"] == "not_fitting+3"
    rows = TauRows(every=100)
    rows.add_row({"step": 200, "loss": 3.0})
    row = rows.add_tau(200, 1.02, 1.5, health_keys(health))[0]
    assert row["loss"] == 3.0 and row["health/tau_fit"] == 1.03 and row["health/verdicts"] == 4
    assert row["health/status"] == "not_fitting+3" and row["health/first_top_share"] == 1.0
    gauges = health_gauges(health)
    assert gauges["checks"]["tau_fit"] == 1.03 and gauges["checks"]["anchor_changed"] == 0.0
    assert gauges["verdicts"] == ["not_fitting", "collapsed", "ignoring_features", "ignoring_anchor"]
    assert health_gauges(None) is None and health_keys(None) == {}
    line = health_line(health)
    assert line.startswith("health at step 200: not_fitting+3 (fit tau 1.03, held-out 1.02")


def test_report_plots_fit_beside_held_out_tau_and_lists_the_verdicts():
    health = _health(STUCK)
    rows = [{"k": "eval", "t": 1.0, "step": 200, "tau": 1.02, "per_pos_accept": [0.0], "health": health}]
    page = render(rows, {"tau_history": [[200, 1.02]]})
    assert '<section id="health"><h2>Drafter health</h2>' in page and "200: not_fitting+3" in page
    assert "not fitting after 200 steps: tau 1.03 on training prompts" in page
    healthy = render(rows[:0], {"health_trained": _health(replace(STUCK, step=60, tau_fit=None, tau=5.0, tau_replay=5.0,
                                                                  first_top_share=0.05, pos1=0.9))})
    assert "healthy: no verdict" in healthy  # no evaluation during the run: the end-of-run checks
    assert 'id="health"' not in render([], {})
