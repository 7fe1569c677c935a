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
- head and layers: whether the drafter's LM head is the target's output embedding, and the first guesses' loss (and
  tau) reading every target layer id - 1 and + 1: a drafter reads the layers it was trained on best, so a lower
  loss next door says the layers differ between training and serving.
- verdicts (app/model/health_verdicts.py): one line per fault a figure shows, its likely causes, where to look.

Stable signatures a benchmark calls directly (a drafter, its `TargetHead`, the target's features of each
sequence [S, k*H] as `features_from_hidden_states` gives them, token id lists; anchors = positions p whose
block [tokens[p], MASK...] sees features of positions < p; None = up to `max_anchors` spread over the text):

    block_hidden(drafter, head, feats_SD, tokens, anchors, anchor_tokens=None) -> [A, B-1, H]
    first_guesses(drafter, head, feats_SD, tokens, anchors, anchor_tokens=None) -> list[int]
    collapse(guesses) -> Collapse(guesses, distinct, top_share, top_token)
    pos1(guesses, tokens, anchors) -> float           # first guesses equal to tokens[p + 1]
    anchor_sensitivity(drafter, head, feats_list, tokens_list, anchors_list=None) -> float
    replay_tau(drafter, head, feats_list, prompts, texts, block_size, max_new_tokens, zero_features=False) -> float
    verdicts(health, cfg) -> list[Verdict];  status_word(verdicts) -> str

Every replayed tau is `app.model.references.tau_on_greedy` over the drafter's own drafts at every anchor, drafted
in one batched forward (`block_hidden`; `draft_block`'s drafts): on a target's greedy output it is the tau
speculative decoding gets (the tests check it equals the decoded one). Nothing here stops or changes a run.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np
import torch

from app.model.health_verdicts import VERDICT_ORDER, Verdict, status_word, verdicts  # noqa: F401 (the stable names)

EAGER_LOGITS = 2**24  # a replay computes every draft's argmax at once below this many logits (64 MiB in fp32)
FEATURE_CACHE_BYTES = 256 * 2**20  # the target features a FeatureCache keeps across evaluations, at most


class FeatureCache:
    """The frozen target's features of the checked texts, kept across evaluations (as the greedy outputs are):
    after the first evaluation the checks run no target forward, while the features fit `max_bytes`."""

    def __init__(self, max_bytes: int = FEATURE_CACHE_BYTES) -> None:
        self.max_bytes, self.nbytes, self.entries = max_bytes, 0, {}

    def features(self, target_model, text: list[int], layer_sets: list[tuple[int, ...]]) -> dict:
        """{layer ids: [S, k*H] features of `text`} for each set, from one target forward or the cache."""
        key = (tuple(text), tuple(layer_sets))
        hit = self.entries.get(key)
        if hit is None:
            from app.model.features import features_from_hidden_states

            states = hidden_states_of(target_model, text)
            hit = {ids: features_from_hidden_states(states, list(ids))[0] for ids in layer_sets}
            size = sum(t.numel() * t.element_size() for t in hit.values())
            if self.nbytes + size <= self.max_bytes:
                self.entries[key], self.nbytes = hit, self.nbytes + size
        return hit


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
    tau_layers_below: float | None  # the same replay reading every target layer id - 1 (None: no such layer)
    tau_layers_above: float | None  # ... every target layer id + 1
    head_is_target: bool | None  # the drafter's LM head equals the target's output embedding (None: not readable)
    first_distinct: int
    first_top_share: float
    target_top_share: float  # the same share of the target's own next tokens there: how varied the text is
    anchor_changed: float  # share of first guesses that change with another anchor token
    pos1: float  # first guesses equal to the target's next token
    anchors: int
    seconds: float
    # Mean cross-entropy (nats) of the first guesses against the target's next tokens, reading the configured layers
    # and every layer id - 1 / + 1 (None: no such layers): a drafter reads the layers it was trained on best.
    pos1_loss: float = 0.0
    pos1_loss_below: float | None = None
    pos1_loss_above: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


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

    return features_from_hidden_states(hidden_states_of(target_model, ids), list(layer_ids))[0]


def hidden_states_of(target_model, ids: list[int]) -> tuple:
    """Every hidden state of the target over `ids` (embedding output first), one forward, no cache."""
    device = next(target_model.parameters()).device
    with torch.no_grad():
        return target_model(input_ids=torch.tensor([ids], device=device), use_cache=False,
                            output_hidden_states=True).hidden_states


def shifted(layer_ids: list[int], by: int, num_layers: int) -> list[int] | None:
    """Every layer id moved by `by`, or None when one falls outside the target's layers 0..num_layers-1."""
    moved = [i + by for i in layer_ids]
    return moved if all(0 <= i < num_layers for i in moved) else None


def head_is_target(head, target_model, rows: int = 64) -> bool | None:
    """Whether the drafter's LM head is the target's output embedding, on `rows` rows spread over the vocabulary
    (a tied head left random differs everywhere); None when the target does not expose one."""
    get = getattr(target_model, "get_output_embeddings", None)
    out = get() if get is not None else None
    if out is None or out.weight.shape != head.lm_head.weight.shape:
        return None if out is None else False
    idx = torch.tensor(spread(0, out.weight.shape[0] - 1, rows))
    mine = head.lm_head.weight[idx.to(head.lm_head.weight.device)].float().cpu()
    theirs = out.weight[idx.to(out.weight.device)].float().cpu()
    return bool(torch.allclose(mine, theirs, rtol=1e-2, atol=1e-3))


def block_hidden(drafter, head, feats_SD: torch.Tensor, tokens: list[int], anchors: list[int],
                 anchor_tokens: list[int] | None = None) -> torch.Tensor:
    """[A, B-1, H]: the drafter's hidden states of positions p+1..p+B-1 at each anchor p of one sequence, in one
    drafter forward (block [tokens[p] or anchor_tokens[i], MASK x (B-1)], seeing the features of positions < p,
    as a block drafted at p during speculative decoding does)."""
    toks = anchor_tokens if anchor_tokens is not None else [tokens[p] for p in anchors]
    return variant_hidden(drafter, head, [feats_SD], [toks], anchors)[0]


def variant_hidden(drafter, head, feats_list: list[torch.Tensor], anchor_tokens_list: list[list[int]],
                   anchors: list[int]) -> torch.Tensor:
    """[N, A, B-1, H]: `block_hidden` for N variants of one sequence at the same anchors (its features zeroed or
    read from other layers, other anchor tokens), all in one drafter forward."""
    arch, B, N, A = drafter.arch, drafter.arch.block_size, len(feats_list), len(anchors)
    dev = feats_list[0].device
    ids = torch.full((N, A * B), arch.mask_token_id, dtype=torch.long, device=dev)
    ids[:, ::B] = torch.tensor(anchor_tokens_list, device=dev)
    dtype = next(drafter.parameters()).dtype
    with torch.no_grad():
        hidden = drafter(head.embed(ids).to(dtype), torch.stack(feats_list).to(dtype),
                         torch.tensor([anchors] * N, device=dev))
    return hidden.view(N, A, B, -1)[:, :, 1:]


def proposals(head, hidden_AQH: torch.Tensor):
    """(i, count) -> the guesses of anchor row i: all rows' argmax at once when their logits are small (one
    matmul), else each guess on first read (`LazyDrafts`: a block costs the rows up to its first miss)."""
    from app.model.spec_bench import LazyDrafts

    A, Q, _ = hidden_AQH.shape
    if A * Q * head.vocab_size <= EAGER_LOGITS:
        table = torch.tensor(argmax_rows(head, hidden_AQH.reshape(A * Q, -1))).view(A, Q).tolist()
        return lambda i, count: table[i][:count]
    return lambda i, count: LazyDrafts(head, hidden_AQH[i, :count])


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


def first_loss(head, hidden_AH: torch.Tensor, next_tokens: list[int]) -> tuple[list[int], float]:
    """(the first guesses, the summed cross-entropy of their logits against `next_tokens`), 256 rows at a time."""
    guesses, loss = [], 0.0
    with torch.no_grad():
        for rows, nexts in zip(hidden_AH.split(256), torch.tensor(next_tokens, device=hidden_AH.device).split(256)):
            logits = head.logits(rows.to(head.lm_head.weight.dtype)).float()
            guesses += logits.argmax(dim=-1).tolist()
            loss += float(torch.nn.functional.cross_entropy(logits, nexts, reduction="sum"))
    return guesses, loss


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
    return mean_tau(per)


def mean_tau(per_forward: list[int]) -> float:
    """Tokens per verify forward (1.0 when nothing was decoded)."""
    return sum(per_forward) / len(per_forward) if per_forward else 1.0


def replay_one(drafter, head, feats_SD, prompt: list[int], text: list[int], block_size: int, max_new_tokens: int,
               hidden=None) -> list[int]:
    """Tokens per verify forward of one prompt (`tau_on_greedy`), the drafts read from one batched forward over
    every anchor the replay can visit (`hidden`: that forward's output [A, B-1, H], when already computed)."""
    from app.model.references import tau_on_greedy

    first = len(prompt)
    anchors = list(range(first, first + len(text) - 1))
    if not anchors:
        return tau_on_greedy(lambda prefix, count: [], prompt, text, block_size, max_new_tokens)
    if hidden is None:
        hidden = block_hidden(drafter, head, feats_SD, prompt + text, anchors)
    guesses = proposals(head, hidden)
    return tau_on_greedy(lambda prefix, count: guesses(len(prefix) - 1 - first, count), prompt, text, block_size,
                         max_new_tokens)


def measure_health(target_model, drafter, head, step: int, tau: float, heldout, fit, max_new_tokens: int,
                   cache: FeatureCache | None = None) -> Health:
    """Every check of one evaluation. `heldout`: (prompt, the target's greedy output) pairs (the ones tau was
    decoded on); `fit`: (prompt, training response) pairs (`fit_sample`). Per prompt: one target forward, and one
    drafter forward over every anchor for five variants at once: as decoded, features zeroed, every layer id - 1
    and + 1, every anchor token swapped for another of the same text. `cache`: the target's features kept across
    evaluations (none: one target forward per prompt each time)."""
    import time

    t0 = time.perf_counter()
    cache = cache if cache is not None else FeatureCache(max_bytes=0)
    layers, B = list(drafter.arch.target_layer_ids), drafter.arch.block_size
    moved = {by: shifted(layers, by, drafter.arch.num_target_layers) for by in (-1, 1)}  # None: no such layers
    layer_sets = [tuple(layers)] + [tuple(ids) for ids in moved.values() if ids is not None]
    per: dict = {"replay": [], "zero": [], -1: [], 1: []}  # tokens per verify forward of each variant
    loss: dict = {"replay": 0.0, -1: 0.0, 1: 0.0}  # summed first-guess cross-entropy, per layer variant
    flat, nexts, changed, counted = [], [], 0, 0
    for prompt, greedy in heldout:
        text = list(prompt) + list(greedy)
        every = list(range(len(prompt), len(text) - 1))  # every anchor the replay can visit
        if not every:
            continue
        feats = cache.features(target_model, text, layer_sets)
        f = feats[tuple(layers)]
        own = [text[p] for p in every]
        swapped = other_tokens(own)
        variants = [("replay", f, own), ("zero", torch.zeros_like(f), own)]
        variants += [(by, feats[tuple(ids)], own) for by, ids in moved.items() if ids]
        hidden = variant_hidden(drafter, head, [v[1] for v in variants] + [f], [v[2] for v in variants] + [swapped],
                                every)
        for k, (name, _, _) in enumerate(variants):
            per[name] += replay_one(drafter, head, None, list(prompt), list(greedy), B, max_new_tokens, hidden[k])
        per.update({by: None for by, ids in moved.items() if ids is None})
        wanted = [text[p + 1] for p in every]
        for k, (name, _, _) in enumerate(variants):
            if name in loss:
                guessed, summed = first_loss(head, hidden[k, :, 0], wanted)
                loss[name] += summed
                if name == "replay":
                    first = guessed
        after = argmax_rows(head, hidden[-1, :, 0])
        flat += first
        nexts += wanted
        for a, b, old, new in zip(first, after, own, swapped):
            if new != old:  # an anchor with no other token to swap in says nothing
                counted += 1
                changed += a != b
    fit_feats = [cache.features(target_model, list(p) + list(r), [tuple(layers)])[tuple(layers)] for p, r in fit]
    tau_fit = replay_tau(drafter, head, fit_feats, [p for p, _ in fit], [r for _, r in fit], B, max_new_tokens) \
        if fit else None
    spread_of = collapse(flat)
    return Health(
        step=step, tau=float(tau), tau_fit=tau_fit, tau_replay=mean_tau(per["replay"]),
        tau_no_features=mean_tau(per["zero"]),
        tau_layers_below=None if per[-1] is None else mean_tau(per[-1]),
        tau_layers_above=None if per[1] is None else mean_tau(per[1]),
        head_is_target=head_is_target(head, target_model),
        first_distinct=spread_of.distinct, first_top_share=spread_of.top_share,
        target_top_share=collapse(nexts).top_share, anchor_changed=changed / counted if counted else 0.0,
        pos1=sum(g == n for g, n in zip(flat, nexts)) / max(len(flat), 1), anchors=len(flat),
        seconds=time.perf_counter() - t0, pos1_loss=loss["replay"] / max(len(flat), 1),
        pos1_loss_below=None if per[-1] is None else loss[-1] / max(len(flat), 1),
        pos1_loss_above=None if per[1] is None else loss[1] / max(len(flat), 1))
