"""`python -m app.report`: one self-contained report.html with every plot, from a synthetic run's files."""
from __future__ import annotations

import base64
import json
import re
import shutil
from types import SimpleNamespace

import pytest

from app.messages import StepRecord
from app.report import main as report_main
from app.run.outputs.report_page import PLOTS, write_report
from app.run.outputs.timeline import Timeline


def _synthetic_run(run_dir) -> None:
    """Two starts (a resume), 3 ranks, 2 targets, two evaluations, one fault."""
    clock = SimpleNamespace(t=1000.0)
    topo = SimpleNamespace(num_targets=2, num_drafters=3, gpus_per_target=1.0, gpus_per_drafter=1.0)
    tl = Timeline(run_dir, pool_every_s=0.0, clock=lambda: clock.t)
    fwd = {0: 0.0, 1: 0.0}
    for start in range(2):
        tl.start(topo, "synthetic", resumed_step=20 * start)
        for step in range(20 * start + 1, 20 * start + 21):
            clock.t += 1.0
            tl.add_records([StepRecord(rank=r, step=step, epoch=0, loss=3.0 / step, weight_sum=1.0,
                                       correct=min(0.9, 0.03 * step), tokens=100, accept_len=1.5,
                                       per_pos_acc=[0.5, 0.3, 0.1], topk_acc=0.8 if step % 10 == 0 else -1.0,
                                       compute_s=0.8, data_wait_s=0.2 * r) for r in range(3)])
            fwd = {t: v + 0.5 + 0.2 * t for t, v in fwd.items()}
            tl.add_pool(SimpleNamespace(q_hsb=[step % 3, 1, 2], buffered=3 + step % 3, capacity_items=8,
                                        pool_bytes=0, pending=1, in_flight=2, leased=3, acked=step, total_jobs=80,
                                        tokens_by_target={0: 50 * step, 1: 60 * step}, forward_s_by_target=dict(fwd),
                                        done_by_target={0: step, 1: step}, targets=[0, 1], restarts={}))
            if step % 10 == 0:
                tl.evaluation(step, 1.0 + step / 20, [0.8 - 0.1 * k + step / 100 for k in range(3)])
            if step == 15:
                tl.note("target 1 job 7: ActorDiedError -> job re-queued, target 1 restarted (1/3)")
        fwd = {0: 0.0, 1: 0.0}  # a new pool after the resume
    tl.close()
    (run_dir / "summary.json").write_text(json.dumps({
        "steps": 40, "loss_first": 3.0, "loss_last": 0.075, "tau_untrained": 1.0, "tau_trained": 3.0,
        "tau_history": [[10, 1.5], [20, 2.0], [30, 2.5], [40, 3.0]],
        "split_advice": {"text": "advice: keep 2 targets / 3 drafters"},
    }))


def test_report_is_self_contained_and_holds_every_plot(tmp_path):
    _synthetic_run(tmp_path)
    out = write_report(tmp_path)
    page = out.read_text()
    # Self-contained: no scripts, stylesheets or images fetched from anywhere.
    assert not re.search(r'(src|href)="(?!data:)', page)
    assert "<script" not in page
    for name in PLOTS:
        m = re.search(rf'<section id="plot-{name}">.*?src="data:image/png;base64,([^"]+)"', page, re.S)
        assert m, name
        png = base64.b64decode(m.group(1))
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000, name  # a drawn plot, not a stub
    assert "ActorDiedError" in page and "driver resumed" in page and "advice: keep 2 targets / 3 drafters" in page


@pytest.mark.slow
def test_report_of_a_run_without_evaluations_says_so(tmp_path):
    Timeline(tmp_path).close()  # an empty but present timeline
    page = write_report(tmp_path).read_text()
    assert page.count('src="data:image/png;base64,') == len(PLOTS)


@pytest.mark.slow
def test_cli(tmp_path, capsys):
    assert report_main([str(tmp_path)]) == 2
    assert "no timeline.jsonl" in capsys.readouterr().err
    _synthetic_run(tmp_path)
    assert report_main([str(tmp_path)]) == 0
    assert (tmp_path / "report.html").exists() and "wrote" in capsys.readouterr().out


def _chromium() -> str | None:
    return next((p for p in (shutil.which("chromium"), shutil.which("chromium-headless-shell"),
                             shutil.which("google-chrome")) if p), None)


@pytest.mark.slow
@pytest.mark.engines
def test_report_renders_in_headless_chromium_without_console_errors(tmp_path, engine):
    """Rendered by a real browser: every image decodes, nothing logs an error or warning. The browser: a
    Chromium on PATH, else the one `playwright install chromium` fetched (what `make test-engines` does)."""
    sync_playwright = engine("playwright.sync_api").sync_playwright

    _synthetic_run(tmp_path)
    page_path = write_report(tmp_path)
    problems: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        page.on("console", lambda m: problems.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
        page.goto(page_path.as_uri())
        drawn = page.evaluate("Array.from(document.images).filter(i => i.complete && i.naturalWidth > 0).map(i => i.alt)")
        page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        browser.close()
    assert drawn == list(PLOTS) and problems == []
    assert (tmp_path / "report.png").stat().st_size > 100_000  # the whole page, plots included
