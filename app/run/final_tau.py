"""tau at the end of the run: a fresh drafter (`tau_untrained`) and the exported one (`tau_trained`).

Both are asked of a live target through `ask_tau`, the call every evaluation during the run makes too
(`TargetActor.evaluate_weights` with the run's one `EvalSpec`, EOS included), so `tau_trained` is the
number the last `tau_history` point gives the same weights. Each has `eval.timeout_s` on a target; a
target that died or hangs is skipped for the next one. Never raises: what could not be measured is
None with the reason, so the summary is written whatever happens here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from app.model.live_eval import EvalSpec
from app.run.failures import last_line


@dataclass(frozen=True)
class TauResult:
    """Acceptance lengths of the untrained and the trained drafter; `reason` says why one is None."""

    untrained: float | None
    trained: float | None
    reason: str | None = None


def ask_tau(handle: Any, step: int, weights: Any, spec: EvalSpec, best_dir: str | None = None,
            beat_tau: float = float("inf")) -> Any:
    """Start one tau measurement on a target (weights: None for a fresh drafter, a folder, or a state dict)."""
    return handle.evaluate_weights.remote(step, weights, spec, best_dir, beat_tau)


class FinalTau:
    """The end-of-run measurement over the live targets, with a deadline per target."""

    def __init__(self, spec: EvalSpec, timeout_s: float, clock: Callable[[], float], log: Callable[[str], None]) -> None:
        self.spec, self.timeout_s, self.clock, self.log = spec, timeout_s, clock, log

    def measure(self, alive: list[tuple[int, Any]], export_dir: str | None, step: int) -> TauResult:
        """`alive`: (target id, handle) of the live targets; `step`: the exported drafter's step."""
        if not self.spec.prompts:
            return TauResult(None, None, "no eval prompts")
        if not alive:
            return TauResult(None, None, "no live target left to measure tau on")
        # Untrained and trained start together on two different targets (when there are two).
        first_u = ask_tau(alive[0][1], 0, None, self.spec)
        first_t = ask_tau(alive[-1][1], step, export_dir, self.spec) if export_dir else None
        started = self.clock()
        tau_u, why_u = self._first_answer(alive, 0, None, first_u, started)
        tau_t, why_t = self._first_answer(alive[::-1], step, export_dir, first_t, started) if export_dir \
            else (None, "nothing was exported")
        reason = "; ".join(f"{k}: {w}" for k, w in (("untrained", why_u), ("trained", why_t)) if w)
        return TauResult(tau_u, tau_t, reason or None)

    def _first_answer(self, candidates: list[tuple[int, Any]], step: int, weights: Any, first_ref: Any,
                      started: float) -> tuple[float | None, str | None]:
        """tau from the first candidate that answers in time; `first_ref` is already running on candidates[0]."""
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        errors = []
        for i, (tid, handle) in enumerate(candidates):
            ref = first_ref if i == 0 else ask_tau(handle, step, weights, self.spec)
            began = started if i == 0 else self.clock()
            try:
                left = max(0.0, self.timeout_s - (self.clock() - began))
                return float(ray.get(ref, timeout=left)["tau"]), None
            except GetTimeoutError:
                ray.cancel(ref, force=True)
                errors.append(f"target {tid} gave no answer within eval.timeout_s={self.timeout_s:g} s")
            except RayError as exc:
                errors.append(f"target {tid}: {last_line(exc)}")
            self.log(f"WARNING: tau evaluation on target {tid} failed ({errors[-1]}); trying the next target")
        return None, "; ".join(errors)
