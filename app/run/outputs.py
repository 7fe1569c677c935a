"""What a run leaves beside its checkpoints, wired into the driver in one place.

- `timeline.jsonl`: step records, pool snapshots, faults, evaluations (app/run/timeline.py);
- the split advice on the status line and in summary.json (app/run/advice.py);
- evaluations during the run every `eval.every_steps`, `tau_history`, `drafter-best/` (app/run/eval_runner.py);
- `report.html` at the end of every run, finished or stopped (app/run/report.py).
"""
from __future__ import annotations

from pathlib import Path

from app.run.advice import SplitAdvisor
from app.run.timeline import FILE_NAME as TIMELINE, Timeline, adopt_remote, read_timeline


class RunOutputs:
    """Listeners of the run's monitor, and what they add to the summary at the end."""

    def __init__(self, cfg, run_name: str, monitor, resumed_step: int, log=print) -> None:
        from app.storage import is_uri, local_cache_dir

        self.cfg, self.monitor, self.log = cfg, monitor, log
        # A URI checkpoint.dir: the files live in its local cache and are uploaded by close().
        self.uri = is_uri(cfg.checkpoint.dir)
        self.run_dir = local_cache_dir(cfg.checkpoint.dir) if self.uri else cfg.checkpoint.dir
        if self.uri:  # resumed on another machine: the remote timeline first, or close() would upload over it
            from app.storage import open_storage

            adopt_remote(open_storage(cfg.checkpoint.dir).read_file(TIMELINE), self.run_dir)
        # Evaluations of earlier starts of this run (a resume): the tau history and best go on from them.
        self.earlier_evals = [r for r in read_timeline(self.run_dir) if r.get("k") == "eval"]
        self.timeline = Timeline(self.run_dir, pool_every_s=min(2.0, cfg.logging.status_every_s))
        self.timeline.start(cfg.topology, run_name, resumed_step)
        monitor.advisor = SplitAdvisor.for_topology(cfg.topology)
        monitor.listeners += [monitor.advisor, self.timeline]
        self.evals = None

    def attach(self, sup) -> None:
        """Once the supervisor has started the pool and the targets: evaluations during the run."""
        from app.config.checks import read_target_info
        from app.run.eval_runner import EvalRunner

        info = read_target_info(sup.plan.model_dir)
        self.evals = EvalRunner(sup, self.monitor, self.timeline, self.log,
                                info.eos_token_ids[0] if info.eos_token_ids else None, self.earlier_evals)
        self.monitor.listeners.append(self.evals)

    def finish(self, final_step: int, export_dir: str | None) -> dict:
        """The last evaluation (of the exported drafter/), then the summary fields: tau_history,
        tau_best, split_advice."""
        if self.evals is not None:
            self.evals.finish(final_step, export_dir)
        out = self.evals.summary() if self.evals is not None else {}
        return {**out, "split_advice": self.monitor.split_advice()}

    def close(self) -> None:
        """Close the timeline and write report.html (a report that cannot be drawn is a warning, not a failure)."""
        from app.run.report import write_report

        from app.storage import open_storage

        self.timeline.close()
        try:
            path = write_report(self.run_dir)
            if self.uri:
                store = open_storage(self.cfg.checkpoint.dir)
                for name in (TIMELINE, "report.html"):
                    store.write_file(name, (Path(self.run_dir) / name).read_bytes())
        except (OSError, ValueError, RuntimeError) as exc:
            self.log(f"WARNING: report.html not written ({type(exc).__name__}: {exc}); "
                     f"python -m app.report {self.run_dir} retries")
            return
        self.log(f"report: {path}")
