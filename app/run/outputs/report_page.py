"""The run report: one self-contained `report.html` from what a run wrote (timeline.jsonl, summary.json).

This module reads the run's files (a local folder, or a URI's through its local cache), lays out the
page and publishes it. The plots (app/run/outputs/report_plots.py) are drawn with matplotlib (Agg, no
display) and embedded as base64 PNG, so the file opens anywhere, offline, and can be mailed. Each plot is
one `<section id="plot-NAME">`; PLOTS lists them. Faults and restarts are drawn as vertical lines on
every time axis and listed in a table.
"""
from __future__ import annotations

import html
import json
from pathlib import Path

from app.run.outputs.report_plots import (plot_acceptance, plot_acceptance_steps, plot_drafter, plot_loss, plot_q_hsb,
                                          plot_target_busy, plot_tau)
from app.run.outputs.timeline import report_rows

FILE_NAME = "report.html"
# Section ids, in page order: what a reader (and the test) finds in every report.
PLOTS = ("loss", "tau", "acceptance", "acceptance_steps", "q_hsb", "target_busy", "drafter_busy", "data_wait")


def write_report(run_dir: str | Path) -> Path:
    """Write `<run_dir>/report.html` atomically; returns its path."""
    run_dir = Path(run_dir)
    rows = report_rows(run_dir)  # streamed; step rows and pool snapshots thinned to what a plot shows
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    page = render(rows, summary, title=run_dir.name or str(run_dir))
    out = run_dir / FILE_NAME
    tmp = out.with_suffix(".html.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return out


def render(rows: list[dict], summary: dict, title: str = "run") -> str:
    """The whole page as a string."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a cluster node; must precede pyplot
    t0 = min((r["t"] for r in rows), default=0.0)
    events = [(r["t"] - t0, r["text"]) for r in rows if r["k"] == "event"]
    events += [(r["t"] - t0, f"re-split {r['old'][0]}/{r['old'][1]} -> {r['new'][0]}/{r['new'][1]} targets/drafters")
               for r in rows if r["k"] == "resplit_done"]  # topology.rebalance=auto (app/run/elastic/resplit_shell.py)
    events += [(r["t"] - t0, f"drafter group grew {r['old']} -> {r['new']} ranks (configured {r['configured']})")
               for r in rows if r["k"] == "grow_done"]  # bundles lost with a node placed again (app/run/elastic/grow_shell.py)
    events += [(r["t"] - t0, f"target {r['target_id']} starting again (its bundle {r['bundle']} placed again)")
               for r in rows if r["k"] == "target_back"]
    events += [(r["t"] - t0, f"extra {r['side'][:-1]} bundle: {r['old'][0]}/{r['old'][1]} -> "
                f"{r['new'][0]}/{r['new'][1]} targets/drafters")
               for r in rows if r["k"] == "extra_done"]  # topology.max_extra_gpus (app/run/elastic/extra_shell.py)
    starts = [r["t"] - t0 for r in rows if r["k"] == "run"][1:]  # resumes: the first start is t=0
    sections = {
        "loss": ("Loss and accuracy over steps", plot_loss(rows)),
        "tau": ("Acceptance length (tau) over steps, best marked", plot_tau(rows, summary)),
        "acceptance": ("Per-position acceptance of the last evaluation", plot_acceptance(rows, summary)),
        "acceptance_steps": ("Per-position acceptance over steps (each evaluation)", plot_acceptance_steps(rows)),
        "q_hsb": ("Buffered items per length bucket (q_hsb) over time", plot_q_hsb(rows, t0, events, starts)),
        "target_busy": ("Per-target busy share over time", plot_target_busy(rows, t0, events, starts)),
        "drafter_busy": ("Per-drafter busy share over time", plot_drafter(rows, t0, events, starts, "busy")),
        "data_wait": ("Drafters' data-wait share over time", plot_drafter(rows, t0, events, starts, "wait")),
    }
    assert tuple(sections) == PLOTS
    body = [f"<h1>dflash-ray run: {html.escape(title)}</h1>", _summary_table(summary), _health_table(rows, summary),
            _serving_table(summary)]
    for key, (heading, png) in sections.items():
        body.append(f'<section id="plot-{key}"><h2>{html.escape(heading)}</h2>'
                    f'<img alt="{key}" src="data:image/png;base64,{png}"></section>')
    body.append(_events_table(events, starts))
    return ("<!doctype html><html><head><meta charset=\"utf-8\"><title>dflash-ray report</title><style>"
            "body{font-family:sans-serif;max-width:1000px;margin:auto}img{max-width:100%}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}"
            "</style></head><body>" + "\n".join(body) + "</body></html>\n")


# ---- tables ------------------------------------------------------------------------------------

_SUMMARY_KEYS = ("steps", "epochs", "jobs_acked", "jobs_scheduled", "loss_first", "loss_last", "train_tok_s",
                 "data_wait", "restarts", "rebalances", "growths", "extra_gpus", "faults", "tau_untrained", "tau_trained",
                 "tau_best", "elapsed_s")


def _summary_table(summary: dict) -> str:
    cells = []
    for key in _SUMMARY_KEYS:
        if summary.get(key) is not None:
            v = summary[key]
            cells.append(f"<tr><th>{key}</th><td>{html.escape(f'{v:.4g}' if isinstance(v, float) else str(v))}</td></tr>")
    advice = (summary.get("split_advice") or {}).get("text")
    if advice:
        cells.append(f"<tr><th>split advice</th><td>{html.escape(advice)}</td></tr>")
    return '<section id="summary"><h2>Summary</h2><table>' + "".join(cells) + "</table></section>" if cells else ""


def _health_table(rows: list[dict], summary: dict) -> str:
    """The drafter's learning checks (app/model/health.py): each evaluation's word, the newest one's figures and
    its verdict lines (likely causes, where to look); nothing when no evaluation measured them."""
    evals = sorted((r for r in rows if r["k"] == "eval" and r.get("health")), key=lambda r: r["step"])
    last = evals[-1]["health"] if evals else summary.get("health") or summary.get("health_trained")
    if not last:
        return ""
    words = ", ".join(f"{r['step']}: {r['health']['status']}" for r in evals) or f"{last['step']}: {last['status']}"
    fit = f"{last['tau_fit']:.2f}" if last.get("tau_fit") is not None else "-"
    figures = (f"fit tau {fit}, held-out tau {last['tau']:.2f}, tau with features zeroed {last['tau_no_features']:.2f}, "
               f"{last['first_distinct']} distinct first guesses (most common {last['first_top_share']:.0%}), "
               f"{last['anchor_changed']:.0%} change with another anchor token, pos1 {last['pos1']:.0%}")
    verdicts = "".join(f"<li>{html.escape(v)}</li>" for v in last["verdicts"]) or "<li>healthy: no verdict</li>"
    return (f'<section id="health"><h2>Drafter health</h2><table><tr><th>by step</th><td>{html.escape(words)}</td>'
            f"</tr><tr><th>step {last['step']}</th><td>{html.escape(figures)}</td></tr></table><ul>{verdicts}</ul>"
            "</section>")


def _serving_table(summary: dict) -> str:
    """How to serve the drafter (the run's launch lines) and the decode speedup its tau buys."""
    lines, est, race = summary.get("serve") or {}, summary.get("serving_estimate"), summary.get("speed_race")
    if not lines and not est and not race:
        return ""
    cells = [f"<tr><th>{html.escape(engine)}</th><td><code>{html.escape(line)}</code></td></tr>"
             for engine, line in lines.items()]
    cells += [f"<tr><th>{html.escape(engine)}</th><td>none: {html.escape(why)}</td></tr>"
              for engine, why in (summary.get("serve_none") or {}).items()]
    if est:
        cells.append(f"<tr><th>expected decode speedup</th><td>{est['speedup']:.2f}x = {est['tau']:.3g} / "
                     f"(1 + 1 / {est['ratio']:.3g}) ({html.escape(est['formula'])}; tau = tokens per target forward "
                     f"measured at the end of the run; ratio = verify/draft cost, from "
                     f"{html.escape(est['ratio_basis'])}; assumes {html.escape(est['assumes'])})</td></tr>")
    if race:
        same = "identical to plain greedy" if race["identical"] else "DIFFERENT from plain greedy (a decoding bug)"
        cells.append(f"<tr><th>measured speedup</th><td>{race['speedup']:.2f}x: speculative "
                     f"{race['spec_tok_s']:.1f} tok/s against the target alone {race['greedy_tok_s']:.1f} tok/s "
                     f"(batch 1, KV cache, {race['prompts']} held-out prompts, tau {race['tau']:.3g}, "
                     f"on this run's device; outputs {same})</td></tr>")
    return '<section id="serving"><h2>Serving</h2><table>' + "".join(cells) + "</table></section>"


def fetch_run_files(location: str) -> Path:
    """A run folder for the report: `location` itself when local; for a URI its local cache, with the
    remote timeline.jsonl (the longer copy wins, app/run/outputs/timeline.py adopt_remote) and summary.json in it."""
    from app.run.outputs.timeline import adopt_remote
    from app.storage.roots import is_uri, local_cache_dir, open_storage

    if not is_uri(location):
        return Path(location)
    local, store = local_cache_dir(location), open_storage(location)
    adopt_remote(store, local)  # streamed, the longer copy wins
    summary = store.read_file("summary.json")
    if summary is not None:
        (local / "summary.json").write_bytes(summary)
    return local


def publish_report(location: str, page: Path) -> str:
    """Where the report of `location` now is: uploaded beside the run's files for a URI, else `page`."""
    from app.storage.roots import is_uri, open_storage

    if not is_uri(location):
        return str(page)
    return open_storage(location).upload_file(FILE_NAME, page)


def _events_table(events, starts) -> str:
    rows = [(t, "fault / restart", text) for t, text in events] + [(t, "driver resumed", "") for t in starts]
    if not rows:
        return '<section id="events"><h2>Faults and restarts</h2><p>none</p></section>'
    body = "".join(f"<tr><td>{t:.1f} s</td><td>{kind}</td><td>{html.escape(text)}</td></tr>"
                   for t, kind, text in sorted(rows))
    return ('<section id="events"><h2>Faults and restarts</h2><table><tr><th>time</th><th>kind</th><th>what</th></tr>'
            + body + "</table></section>")
