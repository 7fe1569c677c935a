"""The run report: one self-contained `report.html` from what a run wrote (timeline.jsonl, summary.json).

Plots are drawn with matplotlib (Agg, no display) and embedded as base64 PNG, so the file opens
anywhere, offline, and can be mailed. Each plot is one `<section id="plot-NAME">`; PLOTS lists them.
Faults and restarts are drawn as vertical lines on every time axis and listed in a table.
"""
from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from app.run.outputs.timeline import report_rows

FILE_NAME = "report.html"
# Section ids, in page order: what a reader (and the test) finds in every report.
PLOTS = ("loss", "tau", "acceptance", "acceptance_steps", "q_hsb", "target_busy", "drafter_busy", "data_wait")
# Per-rank shares are smoothed over this many steps: one step's wait is noise.
SMOOTH_STEPS = 5


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
        "loss": ("Loss and accuracy over steps", _plot_loss(rows)),
        "tau": ("Acceptance length (tau) over steps, best marked", _plot_tau(rows, summary)),
        "acceptance": ("Per-position acceptance of the last evaluation", _plot_acceptance(rows, summary)),
        "acceptance_steps": ("Per-position acceptance over steps (each evaluation)", _plot_acceptance_steps(rows)),
        "q_hsb": ("Buffered items per length bucket (q_hsb) over time", _plot_q_hsb(rows, t0, events, starts)),
        "target_busy": ("Per-target busy share over time", _plot_target_busy(rows, t0, events, starts)),
        "drafter_busy": ("Per-drafter busy share over time", _plot_drafter(rows, t0, events, starts, "busy")),
        "data_wait": ("Drafters' data-wait share over time", _plot_drafter(rows, t0, events, starts, "wait")),
    }
    assert tuple(sections) == PLOTS
    body = [f"<h1>dflash-ray run: {html.escape(title)}</h1>", _summary_table(summary), _serving_table(summary)]
    for key, (heading, png) in sections.items():
        body.append(f'<section id="plot-{key}"><h2>{html.escape(heading)}</h2>'
                    f'<img alt="{key}" src="data:image/png;base64,{png}"></section>')
    body.append(_events_table(events, starts))
    return ("<!doctype html><html><head><meta charset=\"utf-8\"><title>dflash-ray report</title><style>"
            "body{font-family:sans-serif;max-width:1000px;margin:auto}img{max-width:100%}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}"
            "</style></head><body>" + "\n".join(body) + "</body></html>\n")


# ---- plots -------------------------------------------------------------------------------------

def _figure():
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(9, 3.2), dpi=90)


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, color="gray")


def _legend_outside(ax) -> None:
    # Right of the plot: a legend inside would hide the data of a full pool or a busy target.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, borderaxespad=0)


def _time_marks(ax, events, starts) -> None:
    """Faults (red) and driver restarts/resumes (gray) on a time axis."""
    for i, (t, _) in enumerate(events):
        ax.axvline(t, color="red", lw=1, ls="--", label="fault / restart / re-split" if i == 0 else None)
    for i, t in enumerate(starts):
        ax.axvline(t, color="gray", lw=1, ls=":", label="driver resumed" if i == 0 else None)


def _rank0_steps(rows):
    return [r for r in rows if r["k"] == "step" and r["rank"] == 0]


def _plot_loss(rows) -> str:
    fig, ax = _figure()
    steps = _rank0_steps(rows)
    if not steps:
        _empty(ax, "no step records")
        return _png(fig)
    xs = [r["step"] for r in steps]
    ax.plot(xs, [r["loss"] for r in steps], color="C0", label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("weighted CE loss", color="C0")
    acc = ax.twinx()
    acc.plot(xs, [r["correct"] for r in steps], color="C1", label="top-1 accuracy")
    sampled = [(r["step"], r["topk_acc"]) for r in steps if r.get("topk_acc", -1) >= 0]
    if sampled:
        acc.plot(*zip(*sampled), "o", color="C2", ms=3, label="top-5 accuracy")
    acc.set_ylabel("accuracy", color="C1")
    acc.set_ylim(0, 1)
    acc.legend(loc="center right")
    return _png(fig)


def _tau_points(rows, summary) -> list[tuple[int, float]]:
    points = [(r["step"], r["tau"]) for r in rows if r["k"] == "eval"]
    return points or [tuple(p) for p in summary.get("tau_history", [])]


def _plot_tau(rows, summary) -> str:
    fig, ax = _figure()
    points = _tau_points(rows, summary)
    if not points:
        _empty(ax, "no acceptance-length evaluation in this run (eval.every_steps = 0)")
        return _png(fig)
    ax.plot(*zip(*points), "o-", label="tau (greedy speculative decoding, held-out prompts)")
    best = max(points, key=lambda p: p[1])
    ax.plot([best[0]], [best[1]], "*", ms=16, color="gold", mec="black", label=f"best {best[1]:.2f} @ step {best[0]}")
    if summary.get("tau_untrained") is not None:
        ax.axhline(summary["tau_untrained"], color="gray", ls=":", label="untrained drafter")
    ax.set_xlabel("step")
    ax.set_ylabel("tau (tokens / target forward)")
    ax.legend(loc="lower right")
    return _png(fig)


def _plot_acceptance(rows, summary) -> str:
    fig, ax = _figure()
    evals = [r for r in rows if r["k"] == "eval" and r.get("per_pos_accept")]
    if not evals:
        _empty(ax, "no acceptance-length evaluation in this run")
        return _png(fig)
    last = evals[-1]
    acc = last["per_pos_accept"]
    ax.bar(range(1, len(acc) + 1), acc)
    ax.set_xlabel("draft position in the block")
    ax.set_ylabel("share of verify steps accepting it")
    ax.set_ylim(0, 1)
    ax.set_title(f"step {last['step']}, tau {last['tau']:.2f}", fontsize=9)
    return _png(fig)


def _plot_acceptance_steps(rows) -> str:
    """One line per draft position: the share of verify steps accepting it, at each evaluation's step."""
    fig, ax = _figure()
    evals = sorted((r for r in rows if r["k"] == "eval" and r.get("per_pos_accept")), key=lambda r: r["step"])
    if not evals:
        _empty(ax, "no acceptance-length evaluation in this run")
        return _png(fig)
    xs = [r["step"] for r in evals]
    for k in range(max(len(r["per_pos_accept"]) for r in evals)):
        ys = [r["per_pos_accept"][k] if k < len(r["per_pos_accept"]) else float("nan") for r in evals]
        ax.plot(xs, ys, "o-", ms=3, lw=1, label=f"position {k + 1}")
    ax.set_xlabel("step")
    ax.set_ylabel("share of verify steps accepting it")
    ax.set_ylim(0, 1.05)
    _legend_outside(ax)
    return _png(fig)


def _pools(rows, t0):
    # Target ids are JSON object keys in the file (strings); normalise in case rows come from memory.
    return [(r["t"] - t0, {**r, "forward_s_by_target": {str(k): v for k, v in r["forward_s_by_target"].items()}})
            for r in rows if r["k"] == "pool"]


def _plot_q_hsb(rows, t0, events, starts) -> str:
    fig, ax = _figure()
    pools = _pools(rows, t0)
    if not pools:
        _empty(ax, "no pool snapshots")
        return _png(fig)
    ts = [t for t, _ in pools]
    width = max(len(p["q_hsb"]) for _, p in pools)
    series = [[(p["q_hsb"][b] if b < len(p["q_hsb"]) else 0) for _, p in pools] for b in range(width)]
    ax.stackplot(ts, series, labels=[f"bucket {b}" for b in range(width)], step="post")
    ax.plot(ts, [p["capacity_items"] for _, p in pools], color="black", lw=1, label="capacity")
    _time_marks(ax, events, starts)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("items buffered")
    _legend_outside(ax)
    return _png(fig)


def _plot_target_busy(rows, t0, events, starts) -> str:
    """Busy share of target t between snapshots = its forward seconds gained / wall seconds passed."""
    fig, ax = _figure()
    pools = _pools(rows, t0)
    targets = sorted({int(k) for _, p in pools for k in p["forward_s_by_target"]})
    if len(pools) < 2 or not targets:
        _empty(ax, "fewer than two pool snapshots")
        return _png(fig)
    for tid in targets:
        xs, ys = [], []
        for (ta, a), (tb, b) in zip(pools, pools[1:]):
            fa, fb = a["forward_s_by_target"].get(str(tid), 0.0), b["forward_s_by_target"].get(str(tid), 0.0)
            if tb > ta and fb >= fa:  # a new pool after a resume restarts the counters: skip that gap
                xs.append(tb)
                ys.append(min(1.0, (fb - fa) / (tb - ta)))
        ax.plot(xs, ys, lw=1, label=f"target {tid}")
    _time_marks(ax, events, starts)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("share of time in forward")
    _legend_outside(ax)
    return _png(fig)


def _plot_drafter(rows, t0, events, starts, what: str) -> str:
    """Per rank over its last SMOOTH_STEPS steps: busy = compute / (compute + wait), wait = 1 - busy."""
    fig, ax = _figure()
    steps = [r for r in rows if r["k"] == "step"]
    ranks = sorted({r["rank"] for r in steps})
    if not steps:
        _empty(ax, "no step records")
        return _png(fig)
    for rank in ranks:
        mine = [r for r in steps if r["rank"] == rank]
        xs, ys = [], []
        for i in range(len(mine)):
            win = mine[max(0, i - SMOOTH_STEPS + 1): i + 1]
            comp, wait = sum(r["compute_s"] for r in win), sum(r["data_wait_s"] for r in win)
            if comp + wait > 0:
                xs.append(mine[i]["t"] - t0)
                ys.append(comp / (comp + wait) if what == "busy" else wait / (comp + wait))
        ax.plot(xs, ys, lw=1, label=f"drafter {rank}")
    _time_marks(ax, events, starts)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("share of step time computing" if what == "busy" else "share of step time waiting for data")
    _legend_outside(ax)
    return _png(fig)


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


def _serving_table(summary: dict) -> str:
    """How to serve the drafter (the run's launch lines) and the decode speedup its tau buys."""
    lines, est = summary.get("serve") or {}, summary.get("serving_estimate")
    if not lines and not est:
        return ""
    cells = [f"<tr><th>{html.escape(engine)}</th><td><code>{html.escape(line)}</code></td></tr>"
             for engine, line in lines.items()]
    if est:
        cells.append(f"<tr><th>expected decode speedup</th><td>{est['speedup']:.2f}x = {est['tau']:.3g} / "
                     f"(1 + 1 / {est['ratio']:.3g}) ({html.escape(est['formula'])}; tau = tokens per target forward "
                     f"measured at the end of the run; ratio = verify/draft cost, from "
                     f"{html.escape(est['ratio_basis'])}; assumes {html.escape(est['assumes'])})</td></tr>")
    return '<section id="serving"><h2>Serving</h2><table>' + "".join(cells) + "</table></section>"


def fetch_run_files(location: str) -> Path:
    """A run folder for the report: `location` itself when local; for a URI its local cache, with the
    remote timeline.jsonl (the longer copy wins, app/run/outputs/timeline.py adopt_remote) and summary.json in it."""
    from app.run.outputs.timeline import adopt_remote
    from app.storage import is_uri, local_cache_dir, open_storage

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
    from app.storage import is_uri, open_storage

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
