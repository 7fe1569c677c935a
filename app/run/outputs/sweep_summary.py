"""The sweep's own summary.json (several drafter runs on one stream, app/run/sweep.py): the runs side by
side and the stream's target forwards per job. Each run's own summary.json and report.html are the single
run's, in `<checkpoint.dir>/runs/<name>`."""
from __future__ import annotations

KEYS = ("tau_untrained", "tau_trained", "tau_best", "steps", "jobs_acked", "jobs_acked_twice", "jobs_trained_this_run",
        "loss_last", "restarts", "train_tok_s")


def sweep_summary(summaries: dict[str, dict], stream: dict, counted: int | None, jobs: int, elapsed: float) -> dict:
    """The runs side by side, and the forwards per job (1.0: each job ran once on a target): `counted` by the
    live targets' own counters (a restarted target's earlier forwards are not in it), and as the pool issued them."""
    forwards = int(stream.get("forwards", 0))
    return {
        "runs": {n: {k: s.get(k) for k in KEYS} for n, s in summaries.items()},
        "jobs_scheduled": jobs,
        "target_forwards": counted,
        "forwards_per_job": round(counted / jobs, 4) if jobs and counted is not None else None,
        "forwards_issued": forwards,
        "forwards_by_runs_fed": {str(k): v for k, v in sorted(stream.get("forwards_by_runs", {}).items())},
        "elapsed_s": elapsed,
    }


def flat_result(top: dict) -> dict:
    out = {"runs": len(top["runs"]), "jobs_scheduled": top["jobs_scheduled"], "target_forwards": top["target_forwards"],
           "forwards_per_job": top["forwards_per_job"], "forwards_issued": top["forwards_issued"]}
    for n, s in top["runs"].items():
        best = s.get("tau_best")
        out[f"{n}.tau_trained"] = s.get("tau_trained")
        out[f"{n}.tau_best"] = best.get("tau") if isinstance(best, dict) else best
        out[f"{n}.jobs_acked"] = s.get("jobs_acked")
    return out


def render_sweep(top: dict, title: str) -> str:
    """The sweep's report.html: the runs side by side (one row each, tau first), the stream's forwards per
    job, and a link to each run's own report.html (plots, faults, serving lines)."""
    import html

    def cell(v) -> str:
        if isinstance(v, dict):
            v = v.get("tau")
        return html.escape(f"{v:.4g}" if isinstance(v, float) else str(v))

    head = "".join(f"<th>{html.escape(k)}</th>" for k in ("run", *KEYS))
    rows = "".join(f'<tr><td><a href="runs/{html.escape(n)}/report.html">{html.escape(n)}</a></td>'
                   + "".join(f"<td>{cell(s.get(k))}</td>" for k in KEYS) + "</tr>" for n, s in top["runs"].items())
    stream = (f"<p>{top['jobs_scheduled']} jobs, {cell(top['target_forwards'])} target forwards "
              f"({cell(top['forwards_per_job'])} per job) for {len(top['runs'])} runs.</p>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head><body>"
            f"<h1>dflash-ray sweep: {html.escape(title)}</h1>{stream}<table id='runs' border='1'>"
            f"<tr>{head}</tr>{rows}</table></body></html>")
