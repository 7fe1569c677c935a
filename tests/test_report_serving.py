"""report.html (issue 25, items 5 and 6): per-position acceptance over steps, the serving section with the
speed estimate, and `python -m app.report` on a URI run folder (a file:// URI: the same UriStorage path as s3://)."""
from __future__ import annotations

import json
import re

import pytest

from app.model.engines import speed_estimate
from app.report import main as report_main
from app.run.outputs.report_page import render
from tests.test_report import _synthetic_run


def _add_serving(run_dir) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["serve"] = {"vllm": "vllm serve /m --speculative-config '{\"method\": \"dflash\"}'",
                        "sglang": "python -m sglang.launch_server --model-path /m"}
    summary["serving_estimate"] = speed_estimate(3.0, 5.0)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return summary


def test_serving_section_states_formula_inputs_and_ratio():
    summary = {"serve": {"vllm": "vllm serve /m"}, "serving_estimate": speed_estimate(3.0, 5.0)}
    page = render([], summary)
    section = re.search(r'<section id="serving">.*?</section>', page, re.S).group(0)
    assert "2.50x = 3 / (1 + 1 / 5)" in section  # 3 / 1.2
    assert "speedup = tau / (1 + 1 / ratio)" in section and "weights read per forward" in section
    assert "<code>vllm serve /m</code>" in section
    assert 'id="serving"' not in render([], {})  # nothing to say without an export


@pytest.mark.slow
def test_report_on_a_uri_run_folder(tmp_path, capsys):
    remote = tmp_path / "bucket" / "run"
    remote.mkdir(parents=True)
    _synthetic_run(remote)
    _add_serving(remote)
    assert report_main([remote.as_uri()]) == 0
    page = (remote / "report.html").read_text()  # uploaded back beside the run's files
    assert "wrote file://" in capsys.readouterr().out
    m = re.search(r'<section id="plot-acceptance_steps">.*?src="data:image/png;base64,([^"]+)"', page, re.S)
    assert m and len(m.group(1)) > 5000  # drawn from the evaluations' per-position acceptance
    assert "2.50x" in page and "ActorDiedError" in page
