"""Evaluation during the run, the policy: which offer to evaluate, on which target, which tau is the best.

Pure (no Ray): fed offers (rank 0's weights at a step), the pool's in-flight counts and the clock.
- Every measurement of the run, during it and at its end, decodes with one `EvalSpec` (`eval_spec`):
  the same prompts, budget and EOS, so `tau_trained` and the last `tau_history` point agree.
- One evaluation at a time. A newer offer replaces a pending one: evaluation falls behind training
  rather than queueing up, and training never waits for it.
- The target with the fewest training jobs in flight evaluates (it gets no new ones meanwhile).
- A result beats the best when its tau is strictly higher; the first result is the first best.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.model.health import fit_sample
from app.model.drafter_tau import EvalSpec


def eval_spec(plan, eos_token_id: int | None) -> EvalSpec:
    """The run's one EvalSpec: its held-out prompts and settings, decoding up to `eos_token_id`, and the
    learning checks' settings and training sample."""
    cfg = plan.cfg
    # A run of a sweep: its own layers, a subset of what the targets capture (the targets' own otherwise).
    own_layers = tuple(plan.layer_ids) if getattr(plan, "feature_layer_ids", None) else None
    # The learning checks fit on a fixed sample of the run's own training sequences (app/model/health.py).
    data = getattr(plan, "dataset", None)  # None: a plan without data (tests' stand-ins) has no sample to fit on
    fit = tuple(fit_sample(data, cfg.health.fit_prompts, cfg.eval.max_new_tokens)) \
        if cfg.health.enabled and data is not None else ()
    return EvalSpec(plan.eval_prompts, cfg.drafter, cfg.eval, plan.mask_token_id, cfg.train.seed, eos_token_id,
                    cfg.checkpoint.export_dtype, layer_ids=own_layers, health=cfg.health, fit=fit)


@dataclass(frozen=True)
class EvalOffer:
    """Weights to evaluate: `weights` is an object ref to rank 0's numpy state dict, or an exported folder."""

    step: int
    weights: Any


@dataclass
class _Running:
    offer: EvalOffer
    target_id: int
    started: float


class EvalSchedule:
    """At most one evaluation running; the newest offer waits for it."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.pending: EvalOffer | None = None
        self.running: _Running | None = None
        self.superseded = 0  # offers replaced by a newer one before they ran
        self.last_started_step = -1

    def offer(self, offer: EvalOffer) -> None:
        if offer.step <= self.last_started_step:
            return  # a rolled-back group offering a step already evaluated: nothing new
        if self.pending is not None:
            self.superseded += 1
        self.pending = offer

    def start(self, in_flight_by_target: dict[int, int], alive: list[int], now: float) -> _Running | None:
        """The evaluation to start now (and on which target), or None."""
        if self.running is not None or self.pending is None or not alive:
            return None
        # Least loaded target: it stops taking jobs for the evaluation, so the fewest jobs wait on it.
        tid = min(alive, key=lambda t: (in_flight_by_target.get(t, 0), t))
        self.running = _Running(self.pending, tid, now)
        self.last_started_step, self.pending = self.pending.step, None
        return self.running

    def finished(self) -> _Running:
        assert self.running is not None, "finished() without a running evaluation"
        done, self.running = self.running, None
        return done

    def overdue(self, now: float) -> bool:
        return self.running is not None and now - self.running.started > self.timeout_s


@dataclass
class TauBook:
    """Every tau measured during the run and the best one (its step and where it was exported)."""

    history: list[dict] = field(default_factory=list)  # TauMeasurement dicts, in order of step
    best: dict | None = None

    @property
    def best_tau(self) -> float:
        """What a new result must beat (strictly) to be exported as the best; -inf before the first."""
        return self.best["tau"] if self.best is not None else float("-inf")

    def record(self, result: dict) -> bool:
        """Add a result (`step`, `tau`, ...); True when it is the new best."""
        self.history.append(result)
        self.history.sort(key=lambda r: r["step"])
        if result["tau"] > self.best_tau:
            self.best = result
            return True
        return False

    def summary(self) -> dict:
        """`tau_history` ([[step, tau], ...]), `tau_best` and the last per-position acceptance, for summary.json."""
        last = self.history[-1] if self.history else None
        return {
            "tau_history": [[r["step"], r["tau"]] for r in self.history],
            "tau_best": {"step": self.best["step"], "tau": self.best["tau"], "dir": self.best.get("exported_to")}
            if self.best else None,
            "tau_last_per_pos_accept": last["per_pos_accept"] if last else None,
            "tau_matches_greedy": all(r["matches_greedy"] for r in self.history) if self.history else None,
            # The learning checks (app/model/health.py): [step, fit tau, held-out tau] per evaluation, and the
            # newest one's figures, verdict lines and word.
            "health_history": [[r["step"], r["health"]["tau_fit"], r["tau"]] for r in self.history if r.get("health")],
            "health": next((r["health"] for r in reversed(self.history) if r.get("health")), None),
        }


# The learning checks' figures as Prometheus gauges (`dflash_health{check}`) and the metrics' verdict names.
HEALTH_GAUGES = ("tau_fit", "tau_no_features", "first_top_share", "anchor_changed", "pos1")


def health_gauges(health: dict | None) -> dict | None:
    """An evaluation's health as the pool's gauges take it: {check: value} (a missing figure left out) and
    `verdicts`, the names found; None without checks."""
    if not health:
        return None
    return {"checks": {k: float(health[k]) for k in HEALTH_GAUGES if health.get(k) is not None},
            "verdicts": list(health["names"])}


def health_line(health: dict) -> str:
    """One log line of an evaluation's checks: the word, then the figures behind it."""
    fit = f"{health['tau_fit']:.2f}" if health.get("tau_fit") is not None else "-"
    return (f"health at step {health['step']}: {health['status']} (fit tau {fit}, held-out {health['tau']:.2f}, "
            f"no features {health['tau_no_features']:.2f}, first guesses {health['first_distinct']} distinct, top "
            f"{health['first_top_share']:.0%}, anchor changes {health['anchor_changed']:.0%}, pos1 {health['pos1']:.0%}, "
            f"{health['seconds']:.1f} s)")
