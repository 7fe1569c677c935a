# Over 300 lines: the checks, their replay and their verdicts are one unit a benchmark imports whole.
"""Is the drafter learning? Fit, collapse, anchor and feature checks, and a one-line verdict for each fault.

A drafter whose acceptance length stays near 1 is nearly always a wiring fault no loss curve shows: a
tied LM head left random, features never captured, layer ids off by one between training and serving,
a frozen drafter, a chat template that differs. Every evaluation measures, on the prompts it already
decodes (and a fixed sample of training sequences), with the target's features of prompt + continuation
from one target forward per prompt:

- fit: tau replayed on training sequences (their own responses as the text) beside held-out tau. A
  learning drafter fits its data first; both near 1 = it learned nothing; far apart = over-fitting or a
  train/serve mismatch (chat template, thinking mode).
- collapse: distinct first guesses (position anchor+1) over the anchors and the most common one's share.
- anchor: the share of first guesses that change when each anchor token is replaced by another token of
  the same text.
- features: held-out tau replayed with the target features zeroed, beside the same replay with them.
- verdicts: one line per fault a figure shows, with its likely causes and where to look.

Stable signatures a benchmark calls directly (a drafter, its `TargetHead`, the target's features of each
sequence [S, k*H] as `features_from_hidden_states` gives them, token id lists; anchors = positions p whose
block [tokens[p], MASK...] sees features of positions < p, None = up to `max_anchors` spread over the text):

    first_guesses(drafter, head, feats_SD, tokens, anchors, anchor_tokens=None) -> list[int]
    collapse(guesses) -> Collapse(guesses, distinct, top_share, top_token)
    pos1(guesses, tokens, anchors) -> float           # first guesses equal to tokens[p + 1]
    anchor_sensitivity(drafter, head, feats_list, tokens_list, anchors_list=None) -> float
    replay_tau(drafter, head, feats_list, prompts, texts, block_size, max_new_tokens, zero_features=False) -> float
    verdicts(health, cfg) -> list[Verdict];  status_word(verdicts) -> str

Every replayed tau is `app.model.references.tau_on_greedy` over the drafter's own proposals
(`app.model.spec_bench.drafter_proposer`): on a target's greedy output it is the tau speculative decoding
gets. Nothing here stops or changes a run.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np
import torch

VERDICT_ORDER = ("not_fitting", "collapsed", "ignoring_features", "ignoring_anchor", "overfitting")


@dataclass(frozen=True)
class Collapse:
    """How varied the drafter's first guesses are."""

    guesses: int
    distinct: int
    top_share: float  # share of the most common first guess (1.0 = the same token every time)
    top_token: int


@dataclass(frozen=True)
class Health:
    """The checks of one evaluation (figures only; `verdicts` reads them)."""

    step: int
    tau: float  # the evaluation's own held-out tau (speculative decoding)
    tau_fit: float | None  # tau replayed on the fixed training sample (None: no training sample)
    tau_replay: float  # held-out tau replayed with the target features
    tau_no_features: float  # the same replay with the features zeroed
    first_distinct: int
    first_top_share: float
    target_top_share: float  # the same share of the target's own next tokens there: how varied the text is
    anchor_changed: float  # share of first guesses that change with another anchor token
    pos1: float  # first guesses equal to the target's next token
    anchors: int
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Verdict:
    name: str  # one of VERDICT_ORDER
    line: str  # the figure, the likely causes, where to look


def spread(lo: int, hi: int, count: int) -> list[int]:
    """Up to `count` distinct integers evenly spaced over [lo, hi] (both ends included when they fit)."""
    if hi < lo:
        return []
    return sorted({int(round(x)) for x in np.linspace(lo, hi, min(count, hi - lo + 1))})


def fit_sample(dataset, count: int, max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, response) of `count` training sequences evenly spaced over `dataset` (a `TokenizedDataset`):
    the tokens before the first loss token, then the first response's loss tokens, at most `max_new_tokens`."""
    out = []
    for i in spread(0, len(dataset) - 1, count):
        tokens, mask = dataset.sequence(i)
        on = np.flatnonzero(np.asarray(mask))
        if len(on) == 0 or on[0] == 0:
            continue  # no response, or no prompt to decode from
        start = int(on[0])
        stop = start + int(np.argmin(np.append(np.asarray(mask[start:]) != 0, False)))  # end of the first response
        out.append(([int(t) for t in tokens[:start]], [int(t) for t in tokens[start:min(stop, start + max_new_tokens)]]))
    return out


def features_of(target_model, ids: list[int], layer_ids) -> torch.Tensor:
    """[S, k*H]: the target's features of `ids` (one forward, no cache), as speculative decoding reads them."""
    from app.model.features import features_from_hidden_states

    device = next(target_model.parameters()).device
    with torch.no_grad():
        out = target_model(input_ids=torch.tensor([ids], device=device), use_cache=False, output_hidden_states=True)
    return features_from_hidden_states(out.hidden_states, list(layer_ids))[0]


def block_hidden(drafter, head, feats_SD: torch.Tensor, tokens: list[int], anchors: list[int],
                 anchor_tokens: list[int] | None = None) -> torch.Tensor:
    """[A, B-1, H]: the drafter's hidden states of positions p+1..p+B-1 at each anchor p of one sequence, in one
    drafter forward (block [tokens[p] or anchor_tokens[i], MASK x (B-1)], seeing the features of positions < p,
    as a block drafted at p during speculative decoding does)."""
    arch, B = drafter.arch, drafter.arch.block_size
    dev = feats_SD.device
    ids = torch.full((1, len(anchors) * B), arch.mask_token_id, dtype=torch.long, device=dev)
    ids[0, ::B] = torch.tensor(anchor_tokens if anchor_tokens is not None else [tokens[p] for p in anchors], device=dev)
    dtype = next(drafter.parameters()).dtype
    with torch.no_grad():
        hidden = drafter(head.embed(ids).to(dtype), feats_SD[None].to(dtype), torch.tensor([anchors], device=dev))
    return hidden[0].view(len(anchors), B, -1)[:, 1:]


def argmax_rows(head, hidden_RH: torch.Tensor) -> list[int]:
    """The LM head's argmax of each row, 256 rows at a time (a vocab-wide logit matrix per chunk only)."""
    with torch.no_grad():
        return [int(t) for chunk in hidden_RH.split(256) for t in
                head.logits(chunk.to(head.lm_head.weight.dtype)).argmax(dim=-1).tolist()]


def first_guesses(drafter, head, feats_SD: torch.Tensor, tokens: list[int], anchors: list[int],
                  anchor_tokens: list[int] | None = None) -> list[int]:
    """The drafter's first guess (position p + 1) at each anchor p of one sequence, in one drafter forward;
    `anchor_tokens` replaces the token in each anchor slot (None = tokens[p])."""
    if not anchors:
        return []
    return argmax_rows(head, block_hidden(drafter, head, feats_SD, tokens, anchors, anchor_tokens)[:, 0])


def collapse(guesses: list[int]) -> Collapse:
    if not guesses:
        return Collapse(0, 0, 0.0, -1)
    token, count = Counter(guesses).most_common(1)[0]
    return Collapse(len(guesses), len(set(guesses)), count / len(guesses), int(token))


def pos1(guesses: list[int], tokens: list[int], anchors: list[int]) -> float:
    """Share of first guesses equal to the text's next token (tokens[p + 1])."""
    hits = [g == tokens[p + 1] for g, p in zip(guesses, anchors) if p + 1 < len(tokens)]
    return sum(hits) / len(hits) if hits else 0.0


def other_tokens(anchor_tokens: list[int]) -> list[int]:
    """For each anchor token, another token of the same list (half the list away, the next differing one
    past that): an in-distribution replacement, never the token itself (unchanged when all are equal)."""
    n = len(anchor_tokens)
    out = []
    for i, tok in enumerate(anchor_tokens):
        cand = [anchor_tokens[(i + n // 2 + k) % n] for k in range(n)]
        out.append(next((c for c in cand if c != tok), tok))
    return out


def anchor_sensitivity(drafter, head, feats_list, tokens_list, anchors_list=None, max_anchors: int = 64,
                       guesses_list=None) -> float:
    """Share of first guesses that change when each anchor token is replaced by another token of the texts
    (`other_tokens`). `guesses_list`: the first guesses already computed at the same anchors (saves a forward)."""
    anchors_list = anchors_list or [spread(1, len(t) - 2, max_anchors) for t in tokens_list]
    pooled = [toks[p] for toks, anchors in zip(tokens_list, anchors_list) for p in anchors]
    swapped = other_tokens(pooled)
    changed = counted = at = 0
    for i, (feats, toks, anchors) in enumerate(zip(feats_list, tokens_list, anchors_list)):
        mine = swapped[at:at + len(anchors)]
        base = guesses_list[i] if guesses_list is not None else first_guesses(drafter, head, feats, toks, anchors)
        moved = first_guesses(drafter, head, feats, toks, anchors, mine)
        for b, m, new, p in zip(base, moved, mine, anchors):
            if new != toks[p]:  # an anchor with no other token to swap in says nothing
                counted += 1
                changed += b != m
        at += len(anchors)
    return changed / counted if counted else 0.0


def replay_tau(drafter, head, feats_list, prompts, texts, block_size: int, max_new_tokens: int,
               zero_features: bool = False) -> float:
    """tau of the drafter replayed on each prompt's continuation `texts[i]` (a target's greedy output: the tau
    speculative decoding gets; a training response: how well the drafter fits it), features zeroed on request.
    `feats_list[i]`: the target's features of prompt + continuation. Every block is drafted in one forward."""
    per: list[int] = []
    for feats, prompt, text in zip(feats_list, prompts, texts):
        feats = torch.zeros_like(feats) if zero_features else feats
        per += replay_one(drafter, head, feats, list(prompt), list(text), block_size, max_new_tokens)
    return sum(per) / len(per) if per else 1.0


def replay_one(drafter, head, feats_SD, prompt: list[int], text: list[int], block_size: int, max_new_tokens: int,
               hidden=None) -> list[int]:
    """Tokens per verify forward of one prompt (`tau_on_greedy`), the drafts read from one batched forward over
    every anchor the replay can visit (`hidden`: that forward's output, when already computed)."""
    from app.model.references import tau_on_greedy
    from app.model.spec_bench import LazyDrafts

    first = len(prompt)
    anchors = list(range(first, first + len(text) - 1))
    if not anchors:
        return tau_on_greedy(lambda prefix, count: [], prompt, text, block_size, max_new_tokens)
    if hidden is None:
        hidden = block_hidden(drafter, head, feats_SD, prompt + text, anchors)
    return tau_on_greedy(lambda prefix, count: LazyDrafts(head, hidden[len(prefix) - 1 - first, :count]),
                         prompt, text, block_size, max_new_tokens)


def measure_health(target_model, drafter, head, step: int, tau: float, heldout, fit, max_new_tokens: int,
                   max_anchors: int = 64) -> Health:
    """Every check of one evaluation. `heldout`: (prompt, the target's greedy output) pairs (the ones tau was
    decoded on); `fit`: (prompt, training response) pairs (`fit_sample`). Per prompt: one target forward and
    one batched drafter forward each for the replay, the zeroed features and the swapped anchors."""
    import time

    t0 = time.perf_counter()
    layers, B = list(drafter.arch.target_layer_ids), drafter.arch.block_size
    per, per_zero, feats, texts, anchors, guesses, flat, nexts = [], [], [], [], [], [], [], []
    for prompt, greedy in heldout:
        text = list(prompt) + list(greedy)
        f = features_of(target_model, text, layers)
        every = list(range(len(prompt), len(text) - 1))  # every anchor the replay can visit
        hidden = block_hidden(drafter, head, f, text, every) if every else None
        per += replay_one(drafter, head, f, list(prompt), list(greedy), B, max_new_tokens, hidden)
        per_zero += replay_one(drafter, head, torch.zeros_like(f), list(prompt), list(greedy), B, max_new_tokens)
        first = argmax_rows(head, hidden[:, 0]) if every else []
        flat += first
        nexts += [text[p + 1] for p in every]
        pick = spread(0, len(every) - 1, max_anchors)  # the anchor check's subset: it costs a forward of its own
        feats.append(f), texts.append(text), anchors.append([every[i] for i in pick])
        guesses.append([first[i] for i in pick])
    fit_feats = [features_of(target_model, list(p) + list(r), layers) for p, r in fit]
    tau_fit = replay_tau(drafter, head, fit_feats, [p for p, _ in fit], [r for _, r in fit], B, max_new_tokens) \
        if fit else None
    spread_of = collapse(flat)
    return Health(
        step=step, tau=float(tau), tau_fit=tau_fit,
        tau_replay=sum(per) / len(per) if per else 1.0, tau_no_features=sum(per_zero) / len(per_zero) if per_zero else 1.0,
        first_distinct=spread_of.distinct, first_top_share=spread_of.top_share,
        target_top_share=collapse(nexts).top_share,
        anchor_changed=anchor_sensitivity(drafter, head, feats, texts, anchors, guesses_list=guesses),
        pos1=sum(g == n for g, n in zip(flat, nexts)) / max(len(flat), 1), anchors=len(flat),
        seconds=time.perf_counter() - t0)


def verdicts(health: Health, cfg) -> list[Verdict]:
    """One line per fault the figures show (`cfg`: app.config.health_section.HealthConfig), in VERDICT_ORDER;
    [] = healthy, or too early to say (before `cfg.after_steps`)."""
    h = health
    if h.step < cfg.after_steps:
        return []
    out = []
    fit = h.tau_fit if h.tau_fit is not None else h.tau
    where = "training prompts" if h.tau_fit is not None else "held-out prompts (no training sample)"
    if fit < cfg.fit_min_tau:
        out.append(Verdict("not_fitting", (
            f"not fitting after {h.step} steps: tau {fit:.2f} on {where} (held-out {h.tau:.2f}; health.fit_min_tau "
            f"{cfg.fit_min_tau:g}); likely: a frozen drafter or no learning rate (train.lr, requires_grad, the "
            "optimizer's parameter list), the LM head left random (tie_word_embeddings: app/model/target_head.py), "
            "target layer ids off by one between training and serving (model.target_layer_ids, hidden_states[l + 1]), "
            "features never captured; look at the loss curve and pos1")))
    if h.first_top_share >= cfg.collapse_top_share and h.target_top_share < cfg.collapse_top_share:
        out.append(Verdict("collapsed", (
            f"collapsed: {h.first_distinct} distinct first guesses over {h.anchors} anchors, the most common "
            f"{h.first_top_share:.0%} of them (the target's own next tokens: {h.target_top_share:.0%}); likely: the "
            "LM head left random or not the target's (tie_word_embeddings: app/model/target_head.py), a drafter "
            "still at init (train.lr, frozen parameters), a loss that rewards one token (mask_token_id, loss mask)")))
    gain = h.tau_replay - h.tau_no_features
    if gain < cfg.features_min_gain:
        out.append(Verdict("ignoring_features", (
            f"ignoring its features: tau {h.tau_replay:.2f} with the target's features, {h.tau_no_features:.2f} with "
            f"them zeroed (gain {gain:+.2f} < health.features_min_gain {cfg.features_min_gain:g}); likely: target "
            "layer ids off by one between training and serving (model.target_layer_ids), features never captured "
            "(auxiliary hidden states, zero_features), the fc/fusion path skipped")))
    # A drafter whose first guesses are right without reading its anchor reads it from the features: on greedy
    # text the anchor is the target's own argmax at the position before, which its features carry.
    if h.anchor_changed < cfg.anchor_min_changed and h.pos1 < cfg.anchor_pos1_ok:
        out.append(Verdict("ignoring_anchor", (
            f"ignoring its anchor: {h.anchor_changed:.0%} of first guesses change with another anchor token "
            f"(health.anchor_min_changed {cfg.anchor_min_changed:.0%}) and {h.pos1:.0%} are right; likely: a collapsed or untrained drafter, "
            "block embeddings that are not the target's (drafter.mask_token_id, embed_tokens), anchor positions "
            "off by one between training and decoding")))
    if h.tau_fit is not None and h.tau_fit - h.tau > cfg.overfit_gap:
        out.append(Verdict("overfitting", (
            f"over-fitting or a train/serve mismatch: tau {h.tau_fit:.2f} on training prompts, {h.tau:.2f} held out "
            f"(gap > health.overfit_gap {cfg.overfit_gap:g}); likely: too little data for the epochs, a chat template "
            "or thinking mode that differs between the data and the held-out prompts (data.enable_thinking)")))
    return out


def status_word(found: list[Verdict]) -> str:
    """One short word for the status line: ok, or the first verdict's name (+N more)."""
    if not found:
        return "ok"
    return found[0].name + (f"+{len(found) - 1}" if len(found) > 1 else "")
