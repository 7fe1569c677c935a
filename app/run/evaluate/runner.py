"""Evaluation during the run, the Ray side: takes rank 0's offered weights from the pool, runs them on one
target, and sends tau to the status line, the timeline, the `dflash_tau` gauge and `drafter-best/`.

A listener of the RunMonitor: every pool snapshot the supervisor folds in (each loop turn) is a tick.
Everything here is non-blocking (`ray.wait(timeout=0)`), so the supervision loop, and training, never
wait for an evaluation; only `finish` at the end of the run waits, for the last one. Each evaluation has
`eval.timeout_s`; one past it is skipped and its target goes back to training. The runner is handed the
parts it uses, not the supervisor: the run's plan, its one `EvalSpec` (the one the end-of-run tau decodes
with, app/run/evaluate/final_tau.py; targets are asked with `ask_tau`), its `PoolClient` and the query for
the live targets.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from app.run.evaluate.schedule import EvalOffer, EvalSchedule, TauBook, health_gauges, health_line
from app.run.evaluate.final_tau import ask_tau

BEST_DIR_NAME = "drafter-best"


def offered_every(plan) -> int:
    """The steps rank 0 offers its weights for evaluation at (`eval.every_steps`); 0 without held-out prompts.
    The run's monitor is built with it: wandb holds each offered step's row until its tau comes."""
    return plan.cfg.eval.every_steps if plan.eval_prompts else 0


class EvalRunner:
    """Owns the evaluation in flight (one at most) and the book of results."""

    def __init__(self, plan, spec, pool, alive_targets: Callable[[], list[tuple[int, Any]]], monitor, timeline, log,
                 earlier: list[dict] = (), clock=time.monotonic) -> None:
        """`spec`: the run's one EvalSpec (`RunSupervisor.eval_spec`); `pool`: its PoolClient (take_eval,
        pause_target, resume_target, report_tau); `alive_targets`: (id, handle) of the live targets, asked each
        time one is picked; `earlier`: the timeline's `eval` rows of the run's earlier starts."""
        self.plan, self.cfg, self.spec = plan, plan.cfg, spec
        self.pool, self.alive_targets = pool, alive_targets
        self.monitor, self.timeline, self.log, self.clock = monitor, timeline, log, clock
        self.schedule = EvalSchedule(timeout_s=self.cfg.eval.timeout_s)
        self.book = TauBook()
        from app.storage.roots import is_uri

        # Targets write drafter-best/ themselves: on a URI checkpoint.dir they have no path to write to.
        self.best_dir = None if is_uri(self.cfg.checkpoint.dir) else str(Path(self.cfg.checkpoint.dir) / BEST_DIR_NAME)
        self._ref: Any = None
        self._resume(list(earlier))
        self._last_offer = getattr(self.plan, "resume_step", 0) or 0  # the newest offered step seen

    def _resume(self, earlier: list[dict]) -> None:
        """A resumed run goes on with the evaluations of its earlier starts (timeline `eval` rows) and
        the best drafter already exported, so a lower tau never replaces drafter-best/."""
        from app.model.drafter_tau import read_best_meta

        for row in earlier:
            self.book.record({k: row.get(k) for k in ("step", "tau", "per_pos_accept", "matches_greedy")}
                             | {"exported_to": None})
            self.monitor.add_tau(row["step"], row["tau"])
        meta = read_best_meta(self.best_dir) if self.best_dir else None
        if meta is not None and meta["tau"] >= self.book.best_tau:
            self.book.best = {"step": meta["step"], "tau": meta["tau"], "exported_to": self.best_dir}
            self.monitor.known_best(meta["step"], meta["tau"])

    @property
    def enabled(self) -> bool:
        return offered_every(self.plan) > 0

    # ---- RunMonitor listener --------------------------------------------------------------

    def add_records(self, records) -> None:
        """Listener interface; evaluation ticks on pool snapshots."""

    def note(self, event: str) -> None:
        """Listener interface; faults reach the evaluation through its call failing."""

    def add_pool(self, stats) -> None:
        if not self.enabled:
            return
        self._poll()
        offer = self.pool.take_eval()
        if offer is not None:
            step, weights = offer
            self._skipped_before(step)
            self.schedule.offer(EvalOffer(step, weights[0]))
        in_flight = {t: len(jobs) for t, jobs in stats.in_flight_by_target.items()}
        alive = self._alive()
        run = self.schedule.start(in_flight, sorted(alive), self.clock())
        if run is not None:
            self._launch(run.offer, run.target_id, alive[run.target_id])

    # ---- steps ----------------------------------------------------------------------------

    def _skipped_before(self, step: int) -> None:
        """Offers that will report no tau, now that `step` is offered: the one waiting here (replaced) and
        those rank 0 made since the last one seen, which the pool replaced before they were taken."""
        if step <= self.schedule.last_started_step:
            return  # a rolled-back group offering an evaluated step again: the schedule ignores it
        if self.schedule.pending is not None:
            self.monitor.give_up_tau(self.schedule.pending.step)
        every = self.cfg.eval.every_steps
        for missed in range((self._last_offer // every + 1) * every, step, every):
            self.monitor.give_up_tau(missed)
        self._last_offer = max(self._last_offer, step)

    def _alive(self) -> dict[int, Any]:
        """Live targets by id, as the end-of-run evaluation picks them."""
        return dict(self.alive_targets())

    def _launch(self, offer: EvalOffer, tid: int, handle: Any) -> None:
        self.pool.pause_target(tid)
        self._ref = ask_tau(handle, offer.step, offer.weights, self.spec, self.best_dir, self.book.best_tau)

    def _poll(self, timeout: float = 0.0) -> None:
        import ray
        from ray.exceptions import RayError

        if self._ref is None:
            return
        ready, _ = ray.wait([self._ref], timeout=timeout)
        if not ready and not self.schedule.overdue(self.clock()):
            return
        run = self.schedule.finished()
        ref, self._ref = self._ref, None
        self.pool.resume_target(run.target_id)
        if not ready:
            self.monitor.give_up_tau(run.offer.step)
            self.log(f"evaluation of step {run.offer.step} on target {run.target_id} took over "
                     f"eval.timeout_s={self.schedule.timeout_s:g} s; skipped, target back to training")
            return
        try:
            result = ray.get(ref)
        except RayError as exc:  # the target died or the weights' owner (rank 0) was lost: skip this one
            self.monitor.give_up_tau(run.offer.step)
            self.log(f"evaluation of step {run.offer.step} failed on target {run.target_id}: "
                     f"{type(exc).__name__}; training goes on")
            return
        self._record(result)

    def _record(self, result: dict) -> None:
        best = self.book.record(result)
        health = result.get("health")
        self.monitor.add_health(result["step"], health)  # before add_tau: wandb reads both for the step's row
        self.monitor.add_tau(result["step"], result["tau"])
        self.timeline.evaluation(result["step"], result["tau"], result["per_pos_accept"],
                                 matches_greedy=result["matches_greedy"], best=best, seconds=result["seconds"],
                                 **({"health": health} if health else {}))
        self.pool.report_tau(result["step"], result["tau"], health_gauges(health))
        if not result["lossless"]:  # a kept token that is not its verify forward's argmax: an acceptance bug
            self.log(f"WARNING: speculative decoding at step {result['step']} kept tokens the target would not "
                     f"have chosen ({result['mismatch_rate']:.1%} of prompts differ from plain greedy)")
        self.log(f"tau {result['tau']:.3f} at step {result['step']} ({result['seconds']:.1f} s)"
                 + (f", best so far: exported to {result['exported_to']}" if best and result["exported_to"] else ""))
        if health:
            self.log(health_line(health))
            for line in health["verdicts"]:  # a verdict is a line to read, never a stop
                self.log(f"health at step {result['step']}: {line}")

    def finish(self, final_step: int, export_dir: str | None) -> None:
        """End of the run: let the running evaluation land, evaluate the newest offer still pending, then
        the exported drafter/ (what `python -m app.evaluate --drafter` measures) unless its step was
        evaluated; each waits `eval.timeout_s` at most."""
        import ray
        from ray.exceptions import RayError

        if not self.enabled:
            return
        timeout_s = self.cfg.eval.timeout_s
        self._poll(timeout=timeout_s)
        offers = [self.schedule.pending] if self.schedule.pending is not None else []
        self.schedule.pending = None
        if export_dir and final_step not in {o.step for o in offers}:
            offers.append(EvalOffer(final_step, export_dir))
        for offer in offers:  # the newest offer training outran (its owner, rank 0, is still up), then drafter/
            alive = self._alive()
            if not alive or offer.step in {r["step"] for r in self.book.history}:
                continue
            try:
                result = ray.get(ask_tau(next(iter(alive.values())), offer.step, offer.weights, self.spec,
                                         self.best_dir, self.book.best_tau), timeout=timeout_s)
            except (RayError, ray.exceptions.GetTimeoutError) as exc:
                self.log(f"evaluation of step {offer.step} at the end failed: {type(exc).__name__}")
                continue
            self._record(result)

    def summary(self) -> dict:
        return {**self.book.summary(), "eval_superseded": self.schedule.superseded}
