"""The `health` section: the drafter's learning checks measured beside every tau (app/model/health.py) and
the thresholds of their verdicts. A verdict is one line in the logs, the status line, report.html, wandb,
summary.json and the metrics; it never stops or changes a run."""
from __future__ import annotations

from dataclasses import dataclass

from app.config.values import at_least, fail


@dataclass(frozen=True)
class HealthConfig:
    """Fit, collapse, anchor and feature checks of every evaluation, and when each one is a verdict."""

    enabled: bool = True  # measure the checks with every evaluation (during the run and at its end)
    fit_prompts: int = 8  # training sequences in the fixed fit sample (evenly spaced over the dataset; 0 = no fit check)
    after_steps: int = 50  # no verdict before this step: a drafter at init is collapsed and ignores everything
    fit_min_tau: float = 1.3  # not fitting: tau on the training sample below this
    collapse_top_share: float = 0.5  # collapsed: the most common first guess is at least this share (and the target's text is more varied)
    anchor_min_changed: float = 0.2  # ignoring its anchor: fewer first guesses than this share change with another anchor token
    anchor_pos1_ok: float = 0.5  # ...unless this share of its first guesses is right: then the features carry the anchor (greedy text's anchor is the target's own argmax)
    features_min_gain: float = 0.1  # ignoring its features: tau with them minus tau with them zeroed below this
    layer_loss_margin: float = 0.02  # layers off by one: the first guesses' loss reading every layer id - 1 or + 1 is this share below the configured layers' loss
    overfit_gap: float = 1.0  # over-fitting: tau on the training sample minus held-out tau above this

    def __post_init__(self) -> None:
        at_least("health.fit_prompts", self.fit_prompts, 0, "0 turns the fit check off")
        at_least("health.after_steps", self.after_steps, 0, "0 gives verdicts from the first evaluation")
        at_least("health.fit_min_tau", self.fit_min_tau, 1.0, "tau counts the target's own token: 1 is no draft accepted")
        for key, share in (("health.collapse_top_share", self.collapse_top_share),
                           ("health.anchor_min_changed", self.anchor_min_changed),
                           ("health.anchor_pos1_ok", self.anchor_pos1_ok)):
            if not 0.0 <= share <= 1.0:  # a range test: nan fails it too
                fail(key, share, "must be in [0, 1] (a share)")
        at_least("health.features_min_gain", self.features_min_gain, 0.0, "a gain in tokens per verify forward")
        if not 0.0 <= self.layer_loss_margin < 1.0:  # a range test: nan fails it too
            fail("health.layer_loss_margin", self.layer_loss_margin, "must be in [0, 1) (a share)")
        at_least("health.overfit_gap", self.overfit_gap, 0.0, "a gap in tokens per verify forward")
