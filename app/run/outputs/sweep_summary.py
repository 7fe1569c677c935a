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
