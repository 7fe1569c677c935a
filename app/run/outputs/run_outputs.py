"""What a run leaves beside its checkpoints, wired into the driver in one place.

- `timeline.jsonl`: step records, pool snapshots, faults, evaluations (app/run/outputs/timeline.py);
- the split advice and the elastic changes in summary.json (the monitor's planners: app/run/elastic/planners.py);
- evaluations during the run every `eval.every_steps`, `tau_history`, `drafter-best/` (app/run/evaluate/runner.py);
- `report.html` at the end of every run, finished or stopped (app/run/outputs/report_page.py).
"""
from __future__ import annotations

import json
from pathlib import Path

from app.run.outputs.timeline import FILE_NAME as TIMELINE, Timeline, adopt_remote, iter_timeline


class RunOutputs:
    """Listeners of the run's monitor, and what they add to the summary at the end."""

    def __init__(self, cfg, run_name: str, monitor, resumed_step: int, log=print) -> None:
        from app.storage.roots import is_uri, local_cache_dir

        self.cfg, self.monitor, self.log = cfg, monitor, log
        # A URI checkpoint.dir: the files live in its local cache and are uploaded by close().
        self.uri = is_uri(cfg.checkpoint.dir)
        self.run_dir = local_cache_dir(cfg.checkpoint.dir) if self.uri else cfg.checkpoint.dir
        if self.uri:  # resumed on another machine: the remote timeline first, or close() would upload over it
            from app.storage.roots import open_storage

            adopt_remote(open_storage(cfg.checkpoint.dir), self.run_dir)
        # Evaluations of earlier starts of this run (a resume): the tau history and best go on from them.
        # Streamed, evaluations only: the file holds every step row of every earlier start.
        self.earlier_evals = list(iter_timeline(self.run_dir, kinds=("eval",)))
        self.timeline = Timeline(self.run_dir, pool_every_s=min(2.0, cfg.logging.status_every_s))
        self.timeline.start(cfg.topology, run_name, resumed_step)
        monitor.listen(self.timeline)
        self.evals = None

    def attach(self, plan, spec, pool, alive_targets) -> None:
        """Once the supervisor has started the pool and the targets: evaluations during the run, handed the
        run's plan, its one EvalSpec (the end-of-run tau's too), its run-scoped pool client and the stream's
        live-target query."""
        from app.run.evaluate.runner import EvalRunner

        self.evals = EvalRunner(plan, spec, pool, alive_targets, self.monitor, self.timeline, self.log,
                                self.earlier_evals)
        self.monitor.listen(self.evals)

    def finish(self, final_step: int, export_dir: str | None) -> dict:
        """The last evaluation (of the exported drafter/), then the summary fields: tau_history,
        tau_best, split_advice."""
        if self.evals is not None:
            self.evals.finish(final_step, export_dir)
        out = self.evals.summary() if self.evals is not None else {}
        planners = (self.monitor.rebalancer, self.monitor.grower, self.monitor.extra)
        changes = {k: v for p in planners if p is not None for k, v in p.summary().items()}
        return {**out, "split_advice": self.monitor.split_advice(), **changes}

    def close(self) -> None:
        """Close the timeline and write report.html (a report that cannot be drawn is a warning, not a failure)."""
        from app.run.outputs.report_page import write_report

        from app.storage.roots import open_storage

        self.timeline.close()
        try:
            path = write_report(self.run_dir)
            if self.uri:
                store = open_storage(self.cfg.checkpoint.dir)
                for name in (TIMELINE, "report.html"):
                    store.upload_file(name, Path(self.run_dir) / name)  # streamed: never the whole file in memory
        except (OSError, ValueError, RuntimeError) as exc:
            self.log(f"WARNING: report.html not written ({type(exc).__name__}: {exc}); "
                     f"python -m app.report {self.run_dir} retries")
            return
        self.log(f"report: {path}")


def serving_outputs(cfg, model_dir: str, export_dir: str | None, tau: float | None, log=print,
                    verifier: str | None = None) -> dict:
    """After the export: `drafter-speculators/` beside `drafter/` (app/model/engines.py), the vLLM and
    SGLang launch lines with the run's real paths and `block_size - 1`, and the decode speed estimate
    from `tau`. The summary fields `serve`, `serve_none` (a form the engine refuses for this verifier -> why
    it is not in `serve`: `vllm_speculators_main` for a local verifier) and `serving_estimate`; {} when
    nothing was exported. A
    speculators folder that cannot be written is a warning: `drafter/` is what the lines serve. `verifier`: the
    target the engines load, when it is not `model_dir` (a GGUF target: its HF id or .gguf path); the user's
    `checkpoint.verifier` wins over both. The summary's `verifier` is the one written, `verifier_from` where it
    came from."""
    from app.model.engines import SPECULATORS_DIR, cost_ratio, launch_lines, no_main_line, speed_estimate
    from app.storage.fetch import fetch_dir

    if not export_dir:
        return {}
    local = fetch_dir(export_dir, cache=False)  # a URI export: this node's one cached copy (app/storage/local_cache.py)
    chosen = getattr(cfg.checkpoint, "verifier", "")
    verifier, source = ((chosen, "checkpoint.verifier") if chosen
                        else (engine_path(verifier or model_dir), "model.target"))
    spec_dir = None
    try:
        spec_dir = _write_speculators(cfg.checkpoint.dir, export_dir, local, model_dir, verifier)
    except (OSError, ValueError, KeyError) as exc:
        log(f"WARNING: {SPECULATORS_DIR}/ not written ({type(exc).__name__}: {exc})")
    lines = launch_lines(verifier, export_dir, cfg.drafter.block_size, spec_dir)
    # A form the engine refuses for this verifier is not printed; the summary says why in its place.
    none = {"vllm_speculators_main": no_main_line(verifier)} if spec_dir and "vllm_speculators_main" not in lines \
        else {}
    hf = json.loads((local / "config.json").read_text())
    ratio = cost_ratio(model_dir, local, int(hf["vocab_size"]), int(hf["hidden_size"]))
    estimate = speed_estimate(tau, ratio)
    return {"serve": lines, "serve_none": none, "serving_estimate": estimate, "verifier": verifier,
            "verifier_from": source}


def engine_path(name: str) -> str:
    """A verifier as an engine started in another folder finds it: an existing local path made absolute,
    anything else (a hub id, a URI) as given."""
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


def print_serving(summary: dict, log=print) -> None:
    """The launch lines (and the estimate) at the end of a run, one per line."""
    if summary.get("verifier"):
        log(f"verifier (the target engines load, named in drafter-speculators/config.json): {summary['verifier']} "
            f"(from {summary.get('verifier_from', 'model.target')}); to name another, a hub id or a path on the "
            "serving machine, set checkpoint.verifier=... or edit speculators_config.verifier.name_or_path there")
    for engine, line in (summary.get("serve") or {}).items():
        log(f"serve with {engine}: {line}")
    for engine, why in (summary.get("serve_none") or {}).items():
        log(f"no {engine} line: {why}")
    est = summary.get("serving_estimate")
    if est:
        log(f"expected decode speedup {est['speedup']:.2f}x ({est['formula']}, tau {est['tau']:.2f}, verify/draft "
            f"cost ratio {est['ratio']:.1f} from {est['ratio_basis']})")


def _write_speculators(root: str, export_dir: str, local: Path, model_dir: str, verifier: str | None = None) -> str:
    """The speculators-format folder `<root>/drafter-speculators` from the export (`local`: its files on
    this node), published as the export is (atomic locally, config.json last on a URI)."""
    import os

    from app.model.export import publish_export
    from app.model.engines import SPECULATORS_DIR, write_speculators
    from app.storage.roots import is_uri, open_storage

    if not is_uri(root):
        return str(publish_export(os.path.join(root, SPECULATORS_DIR),
                                  lambda tmp: write_speculators(export_dir, tmp, model_dir, verifier)))
    store = open_storage(root)
    with store.scratch(SPECULATORS_DIR) as tmp:  # in this user's cache root: a SIGKILL's leftover is cleaned
        write_speculators(local, tmp, model_dir, verifier)
        return store.upload_dir(tmp, SPECULATORS_DIR, last="config.json")
