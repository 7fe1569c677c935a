"""The verdicts of the drafter's learning checks (app/model/health.py): one line per fault a figure shows, with
its likely causes and where to look, and one word for the status line. Pure: figures and thresholds in, lines
out; a verdict never stops or changes a run."""
from __future__ import annotations

from dataclasses import dataclass

# Most telling first: the status line shows the first one found.
VERDICT_ORDER = ("head_not_target", "layers_off", "not_fitting", "collapsed", "ignoring_features", "ignoring_anchor",
                 "overfitting")


@dataclass(frozen=True)
class Verdict:
    name: str  # one of VERDICT_ORDER
    line: str  # the figure, the likely causes, where to look


def verdicts(health, cfg) -> list[Verdict]:
    """One line per fault the figures of `health` (an `app.model.health.Health`) show under `cfg`
    (`app.config.health_section.HealthConfig`), in VERDICT_ORDER; [] = healthy, or too early to say (before
    `cfg.after_steps`, when a drafter at init fails every check)."""
    h = health
    if h.step < cfg.after_steps:
        return []
    found = [v for v in (_head(h), _layers(h, cfg), _fit(h, cfg), _collapse(h, cfg), _features(h, cfg),
                         _anchor(h, cfg), _overfit(h, cfg)) if v is not None]
    return sorted(found, key=lambda v: VERDICT_ORDER.index(v.name))


def status_word(found: list[Verdict]) -> str:
    """One short word for the status line: ok, or the first verdict's name (+N more)."""
    if not found:
        return "ok"
    return found[0].name + (f"+{len(found) - 1}" if len(found) > 1 else "")


def _head(h) -> Verdict | None:
    if h.head_is_target is not False:
        return None
    return Verdict("head_not_target", (
        "LM head is not the target's: the drafter's logits come from another matrix than the target's output "
        "embedding; likely: a tied head left random (tie_word_embeddings ignored, lm_head.weight missing from "
        "the checkpoint: app/model/target_head.py), a head from another checkpoint"))


def _layers(h, cfg) -> Verdict | None:
    # The loss, not tau: a few prompts' tau moves by a block or two between neighbouring layers of a small target,
    # while the first guesses' loss over every anchor is lowest on the layers the drafter was trained on.
    near = [(side, loss, tau) for side, loss, tau in (("- 1", h.pos1_loss_below, h.tau_layers_below),
                                                      ("+ 1", h.pos1_loss_above, h.tau_layers_above)) if loss is not None]
    if not near:
        return None
    side, best, tau = min(near, key=lambda n: n[1])
    if best >= h.pos1_loss * (1 - cfg.layer_loss_margin):
        return None
    return Verdict("layers_off", (
        f"target layer ids off by one: the first guesses' loss is {best:.3f} reading every layer id {side} against "
        f"{h.pos1_loss:.3f} with the configured ones (tau {tau:.2f} vs {h.tau_replay:.2f}; health.layer_loss_margin "
        f"{cfg.layer_loss_margin:g}); likely: layer ids that differ between training and serving "
        "(model.target_layer_ids, hidden_states[l + 1] vs [l], an engine's aux layer convention)"))


def _fit(h, cfg) -> Verdict | None:
    fit = h.tau_fit if h.tau_fit is not None else h.tau
    if fit >= cfg.fit_min_tau:
        return None
    where = "training prompts" if h.tau_fit is not None else "held-out prompts (no training sample)"
    return Verdict("not_fitting", (
        f"not fitting after {h.step} steps: tau {fit:.2f} on {where} (held-out {h.tau:.2f}; health.fit_min_tau "
        f"{cfg.fit_min_tau:g}); likely: a frozen drafter or no learning rate (train.lr, requires_grad, the "
        "optimizer's parameter list), the LM head left random (tie_word_embeddings: app/model/target_head.py), "
        "target layer ids off by one between training and serving (model.target_layer_ids), features never "
        f"captured; pos1 {h.pos1:.0%}: look at the loss curve"))


def _collapse(h, cfg) -> Verdict | None:
    if h.first_top_share < cfg.collapse_top_share or h.target_top_share >= cfg.collapse_top_share:
        return None  # varied guesses, or a text as repetitive as they are
    return Verdict("collapsed", (
        f"collapsed: {h.first_distinct} distinct first guesses over {h.anchors} anchors, the most common "
        f"{h.first_top_share:.0%} of them (the target's own next tokens: {h.target_top_share:.0%}); likely: a "
        "drafter still at init (train.lr, frozen parameters), the LM head left random or not the target's "
        "(tie_word_embeddings), features zeroed or never captured, a loss that rewards one token "
        "(drafter.mask_token_id, the loss mask)"))


def _features(h, cfg) -> Verdict | None:
    gain = h.tau_replay - h.tau_no_features
    if gain >= cfg.features_min_gain:
        return None
    return Verdict("ignoring_features", (
        f"ignoring its features: tau {h.tau_replay:.2f} with the target's features, {h.tau_no_features:.2f} with "
        f"them zeroed (gain {gain:+.2f} < health.features_min_gain {cfg.features_min_gain:g}); likely: features "
        "never captured or zeroed (auxiliary hidden states, drafter.zero_features), target layer ids off by one "
        "between training and serving (model.target_layer_ids), the fc/fusion path skipped"))


def _anchor(h, cfg) -> Verdict | None:
    # A drafter whose first guesses are right without reading its anchor reads it from the features: on greedy
    # text the anchor is the target's own argmax at the position before, which its features carry.
    if h.anchor_changed >= cfg.anchor_min_changed or h.pos1 >= cfg.anchor_pos1_ok:
        return None
    return Verdict("ignoring_anchor", (
        f"ignoring its anchor: {h.anchor_changed:.0%} of first guesses change with another anchor token "
        f"(health.anchor_min_changed {cfg.anchor_min_changed:.0%}) and {h.pos1:.0%} are right; likely: a collapsed "
        "or untrained drafter, block embeddings that are not the target's (drafter.mask_token_id, embed_tokens), "
        "anchor positions off by one between training and decoding"))


def _overfit(h, cfg) -> Verdict | None:
    if h.tau_fit is None or h.tau_fit - h.tau <= cfg.overfit_gap:
        return None
    return Verdict("overfitting", (
        f"over-fitting or a train/serve mismatch: tau {h.tau_fit:.2f} on training prompts, {h.tau:.2f} held out "
        f"(gap > health.overfit_gap {cfg.overfit_gap:g}); likely: too little data for the epochs, a chat template "
        "or thinking mode that differs between the data and the held-out prompts (data.enable_thinking)"))
