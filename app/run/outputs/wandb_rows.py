"""What goes into a wandb step row, pure: the tau of the step it was measured at, and the pool per bucket.

- `TauRows` holds step rows back while an evaluation of one of their steps may still report, so tau and
  the best tau so far land in the row of the step they were measured at (one x-axis with the loss).
  Evaluations run beside training (app/run/evaluate/runner.py): rank 0 offers every `eval.every_steps`
  steps, the result comes some steps later or never (skipped past `eval.timeout_s`, failed, or replaced
  by a newer offer). A row of an offered step holds itself and every later row (wandb's rows are
  ordered) until its tau arrives, a later step's tau arrives, the runner says it will not come, or more
  than `max_held` rows wait; a tau that finds no held row of its step (held past that bound) is its
  own row (`event: eval`, `eval_step`). A driver killed outright loses the rows held at that moment.
- `pool_keys`: the pool per length bucket (queued items, pulls served, items produced) and the pull
  waits (the pool measures them over all buckets), the numbers the Ray dashboard shows, as wandb keys.
"""
from __future__ import annotations

from typing import Any

MAX_HELD = 512  # rows; a bound on what a lost evaluation can delay, not a wait anyone should reach


class TauRows:
    """Step rows in, rows to write out (in order), with `tau` and `tau_best` in the row of their step."""

    def __init__(self, every: int = 0, max_held: int = MAX_HELD) -> None:
        self.every, self.max_held = every, max_held
        self.held: list[dict[str, Any]] = []
        self._given_up: set[int] = set()  # offered steps that will not report (or were held too long)
        self._measured = -1  # the newest step a tau arrived for: offers before it will not report either

    def _awaits(self, step: int) -> bool:
        return (self.every > 0 and step > 0 and step % self.every == 0 and step > self._measured
                and step not in self._given_up)

    def add_row(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        self.held.append(row)
        return self._ready()

    def add_tau(self, step: int, tau: float, best: float, extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """A tau measured at `step`: into the held row of that step (the last one: a rollback repeats
        steps), or a row of its own when none is held; `extra` (the evaluation's health keys) goes with it."""
        self._measured = max(self._measured, step)
        row = next((r for r in reversed(self.held) if r.get("step") == step), None)
        if row is None:
            return [{"event": "eval", "eval_step": step, "tau": tau, "tau_best": best, **(extra or {})}] + self._ready()
        row.update(tau=tau, tau_best=best, **(extra or {}))
        return self._ready()

    def give_up(self, step: int) -> list[dict[str, Any]]:
        """The evaluation of `step` will not report (timed out, failed, replaced by a newer offer)."""
        self._given_up.add(step)
        return self._ready()

    def flush(self) -> list[dict[str, Any]]:
        rows, self.held = self.held, []
        return rows

    def _ready(self) -> list[dict[str, Any]]:
        """The held rows before the first one still awaiting its tau."""
        cut = self._first_awaiting(0)
        while len(self.held) - cut > self.max_held:  # a tau that never comes must not hold the history forever
            self._given_up.add(self.held[cut]["step"])
            cut = self._first_awaiting(cut)
        ready, self.held = self.held[:cut], self.held[cut:]
        return ready

    def _first_awaiting(self, start: int) -> int:
        return next((i for i in range(start, len(self.held)) if self._awaits(self.held[i].get("step", 0))),
                    len(self.held))


def health_keys(health: dict | None) -> dict[str, Any]:
    """An evaluation's learning checks (app/model/health.py) as wandb keys: `health/<figure>` (a figure not
    measured left out), `health/verdicts` (how many) and `health/status` (ok or the first verdict)."""
    if not health:
        return {}
    figures = ("tau_fit", "tau_replay", "tau_no_features", "tau_layers_below", "tau_layers_above", "pos1_loss", "first_distinct",
               "first_top_share", "anchor_changed", "pos1", "seconds")
    return {**{f"health/{k}": health[k] for k in figures if health.get(k) is not None},
            "health/verdicts": len(health["names"]), "health/status": health["status"]}


def pool_keys(stats) -> dict[str, float]:
    """A PoolStats snapshot as a handful of bucket-labelled wandb keys (none without a snapshot)."""
    if stats is None:
        return {}
    out: dict[str, float] = {}
    for name, per_bucket in (("queued", stats.q_hsb), ("pulls", stats.served_per_bucket),
                             ("produced", stats.produced_per_bucket)):
        out.update({f"pool/bucket{b}/{name}": n for b, n in enumerate(per_bucket)})
    waits = stats.pull_waits
    out.update({"pool/pull_waits": waits.count, "pool/pull_wait_p50_s": waits.p50_s,
                "pool/pull_wait_p95_s": waits.p95_s, "pool/buffered": stats.buffered,
                "pool/capacity_items": stats.capacity_items})
    return out
