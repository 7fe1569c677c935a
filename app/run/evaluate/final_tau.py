"""tau at the end of the run: a fresh drafter (`tau_untrained`) and the exported one (`tau_trained`).

Both are asked of a live target through `ask_tau`, the call every evaluation during the run makes too
(`TargetActor.evaluate_weights` with the run's one `EvalSpec`, EOS included), so `tau_trained` is the
number the last `tau_history` point gives the same weights. Each has `eval.timeout_s` on a target; a
target that died or hangs is skipped for the next one (and by the other measurement); the untrained and
the trained measurement each have their own budget. Never raises: what could not be measured is
None with the reason, so the summary is written whatever happens here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from app.model.drafter_tau import EvalSpec
from app.run.supervise.events import last_line


@dataclass(frozen=True)
class TauResult:
    """Acceptance lengths of the untrained and the trained drafter; `reason` says why one is None."""

    untrained: float | None
    trained: float | None
    reason: str | None = None
    race: dict | None = None  # the exported drafter's speed race (app.model.drafter_tau.RaceLine), when measured
    health: dict | None = None  # the exported drafter's learning checks (TauMeasurement.health), when measured


def ask_tau(handle: Any, step: int, weights: Any, spec: EvalSpec, best_dir: str | None = None,
            beat_tau: float = float("inf")) -> Any:
    """Start one tau measurement on a target (weights: None for a fresh drafter, a folder, a state dict, or
    an object ref to one). A ref travels inside a list, so the target fetches it itself, with retries:
    Ray resolving it before the call would fail the evaluation on the first transient fetch error."""
    from ray import ObjectRef

    return handle.evaluate_weights.remote(step, [weights] if isinstance(weights, ObjectRef) else weights, spec,
                                          best_dir, beat_tau)


class FinalTau:
    """The end-of-run measurement over the live targets, with a deadline per target and per measurement."""

    def __init__(self, spec: EvalSpec, timeout_s: float, clock: Callable[[], float], log: Callable[[str], None],
                 get: Callable[[Any, float], Any] | None = None) -> None:
        # Training is over: measure at normal priority (an idle-class thread starves beside any other process).
        self.spec = dataclasses.replace(spec, background=False)
        self.timeout_s, self.clock, self.log = timeout_s, clock, log
        self._get = get or _ray_get
        self._hung: set[int] = set()  # targets that gave no answer in time: the other measurement skips them

    def measure(self, alive: list[tuple[int, Any]], export_dir: str | None, step: int) -> TauResult:
        """`alive`: (target id, handle) of the live targets; `step`: the exported drafter's step."""
        try:
            return self._measure(alive, export_dir, step)
        except Exception as exc:  # the summary is written whatever happens here: report, never raise
            self.log(f"WARNING: end-of-run tau not measured ({type(exc).__name__}: {last_line(exc)})")
            return TauResult(None, None, f"{type(exc).__name__}: {last_line(exc)}")

    def _measure(self, alive: list[tuple[int, Any]], export_dir: str | None, step: int) -> TauResult:
        if not self.spec.prompts:
            return TauResult(None, None, "no eval prompts")
        if not alive:
            return TauResult(None, None, "no live target left to measure tau on")
        # Untrained and trained start together on two different targets (when there are two), each with
        # its own eval.timeout_s; on one target the trained one is asked only once the untrained one ended,
        # since an actor runs one call at a time and the two would otherwise share one budget.
        two = len(alive) > 1
        first_u = (ask_tau(alive[0][1], 0, None, self.spec), self.clock())
        first_t = (ask_tau(alive[-1][1], step, export_dir, self.spec), self.clock()) if export_dir and two else None
        tau_u, why_u = self._first_answer(alive, 0, None, first_u)
        tau_t, why_t = self._first_answer(alive[::-1], step, export_dir, first_t) if export_dir \
            else (None, "nothing was exported")
        health = (tau_t or {}).get("health")
        tau_u, tau_t = (float(r["tau"]) if r is not None else None for r in (tau_u, tau_t))
        race, why_r = self._race(alive, export_dir) if export_dir and self.spec.eval.race_prompts \
            else (None, None)
        reason = "; ".join(f"{k}: {w}" for k, w in (("untrained", why_u), ("trained", why_t), ("race", why_r)) if w)
        return TauResult(tau_u, tau_t, reason or None, race, health)

    def _race(self, alive: list[tuple[int, Any]], export_dir: str) -> tuple[dict | None, str | None]:
        """The exported drafter against the target alone on the first live target that has not hung and
        answers within eval.timeout_s (TargetActor.race_weights); a dead one is passed over for the next."""
        from ray.exceptions import GetTimeoutError, RayError

        errors = []
        for tid, handle in alive:
            if tid in self._hung:
                continue
            try:
                return self._get(handle.race_weights.remote(export_dir, self.spec), self.timeout_s), None
            except GetTimeoutError:
                self._hung.add(tid)  # a hung race holds its target: trying another would double the wait
                errors.append(f"target {tid} gave no answer within eval.timeout_s={self.timeout_s:g} s")
                break
            except RayError as exc:
                errors.append(f"target {tid}: {last_line(exc)}")
        return None, "; ".join(errors) or "every live target hung in a tau measurement"

    def _first_answer(self, candidates: list[tuple[int, Any]], step: int, weights: Any,
                      first: tuple[Any, float] | None) -> tuple[dict | None, str | None]:
        """The evaluation (TauMeasurement dict) from the first candidate that answers in time; `first` (ref, started)
        already runs on candidates[0]."""
        from ray.exceptions import GetTimeoutError, RayError

        errors = []
        for i, (tid, handle) in enumerate(candidates):
            if tid in self._hung:
                continue
            ref, began = first if i == 0 and first is not None else (ask_tau(handle, step, weights, self.spec),
                                                                      self.clock())
            try:
                left = max(0.0, self.timeout_s - (self.clock() - began))
                return self._get(ref, left), None
            except GetTimeoutError:
                self._hung.add(tid)
                errors.append(f"target {tid} gave no answer within eval.timeout_s={self.timeout_s:g} s")
            except RayError as exc:
                errors.append(f"target {tid}: {last_line(exc)}")
            self.log(f"WARNING: tau evaluation on target {tid} failed ({errors[-1]}); trying the next target")
        return None, "; ".join(errors) or "every live target hung in the other measurement"


def _ray_get(ref: Any, timeout: float) -> Any:
    """Wait for one evaluation; on timeout drop it from the target's queue and raise GetTimeoutError.

    An actor task cannot be force-cancelled (`ray.cancel(force=True)` raises ValueError on one); a plain
    cancel removes a call still queued, while a call already running finishes on its own."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(ref, timeout=timeout)
    except GetTimeoutError:
        ray.cancel(ref)
        raise
