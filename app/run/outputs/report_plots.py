"""The report's plots: each one a matplotlib figure (Agg, no display) of a run's timeline rows, returned
as a base64 PNG for `report.html` (app/run/outputs/report_page.py lays out the page). Time-axis plots mark
faults and restarts (`events`, red) and driver resumes (`starts`, gray); a plot with nothing to draw says
so in gray instead.
"""
from __future__ import annotations

import base64
import io

# Per-rank shares are smoothed over this many steps: one step's wait is noise.
SMOOTH_STEPS = 5


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


def plot_loss(rows) -> str:
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


def _fit_points(rows, summary) -> list[tuple[int, float]]:
    """(step, tau on the fixed training sample) of each evaluation that measured it (its health checks)."""
    points = [(r["step"], r["health"]["tau_fit"]) for r in rows
              if r["k"] == "eval" and (r.get("health") or {}).get("tau_fit") is not None]
    return points or [(s, f) for s, f, _ in summary.get("health_history", []) if f is not None]


def plot_tau(rows, summary) -> str:
    fig, ax = _figure()
    points = _tau_points(rows, summary)
    if not points:
        _empty(ax, "no acceptance-length evaluation in this run (eval.every_steps = 0)")
        return _png(fig)
    ax.plot(*zip(*points), "o-", label="tau (greedy speculative decoding, held-out prompts)")
    fit = _fit_points(rows, summary)
    if fit:  # a learning drafter fits its data first: both near 1 = nothing learned, far apart = over-fitting
        ax.plot(*zip(*fit), "s--", color="tab:green", label="tau on the training sample (fit, app/model/health.py)")
    best = max(points, key=lambda p: p[1])
    ax.plot([best[0]], [best[1]], "*", ms=16, color="gold", mec="black", label=f"best {best[1]:.2f} @ step {best[0]}")
    if summary.get("tau_untrained") is not None:
        ax.axhline(summary["tau_untrained"], color="gray", ls=":", label="untrained drafter")
    ax.set_xlabel("step")
    ax.set_ylabel("tau (tokens / target forward)")
    ax.legend(loc="lower right")
    return _png(fig)


def plot_acceptance(rows, summary) -> str:
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


def plot_acceptance_steps(rows) -> str:
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


def plot_q_hsb(rows, t0, events, starts) -> str:
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


def plot_target_busy(rows, t0, events, starts) -> str:
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


def plot_drafter(rows, t0, events, starts, what: str) -> str:
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
