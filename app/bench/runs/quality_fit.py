"""What `python -m app.bench quality --target smol` measures of each drafter and reference, beside held-out tau.

A drafter that learns fits its own data first, and a drafter that drafts reads its anchor and its features.
So every proposer is replayed (`app.model.references.tau_on_greedy`: the tau speculative decoding gets on the
target's greedy output) on two prompt sets, and the trained drafters are probed:

- held out: the bench's held-out prompts and the target's greedy outputs (tau, tau_pos, pos1);
- training: a fixed sample of the training prompts with their responses, which are the target's own greedy
  outputs too (tau_train, pos1_train): how well the proposer fits what it was trained on;
- pos1: the share of verify forwards whose first draft was accepted (first-position acceptance);
- anchor_sensitivity: the share of first guesses that change when the anchor token is swapped for another
  token of the texts (`app.model.health.anchor_sensitivity`): 0 = the drafter ignores its anchor;
- first_top_share: the most common first guess's share over every held-out anchor (1.0 = a constant guess).

The references on the same prompts: `bigram` (the n-gram table of order 1 over the training responses: what
a table that only reads the anchor fits), `ngram` (order 3), `prompt_lookup` (vLLM's n-gram proposer) and
`hybrid` (what a CPU user would run: prompt lookup where it has a match, the drafter otherwise).
"""
from __future__ import annotations

import torch

FIT_PROMPTS = 32  # training prompts replayed for tau_train (spread over the training set)
REF_BLOCK = 16  # the training-free references' block: what lookup may propose does not shrink with the drafter's


def fit_set(plan, feats, max_new_tokens: int, count: int = FIT_PROMPTS) -> dict:
    """A fixed sample of training sequences as replay inputs: prompts, responses (up to `max_new_tokens`),
    the target features of each sequence (`feats`, indexed as the plan's dataset)."""
    from app.model.health import spread

    prompts, refs, fs = [], [], []
    for i in spread(0, len(plan.dataset) - 1, count):
        ids, mask = plan.dataset.sequence(i)
        ids = [int(t) for t in ids]
        first = next((j for j, m in enumerate(mask) if m), None)
        if not first:
            continue
        prompts.append(ids[:first])
        refs.append(ids[first:first + max_new_tokens])
        fs.append(feats.of(i))
    return {"prompts": prompts, "refs": refs, "feats": fs}


def replay(proposer_for, prompts, refs, block_size: int, max_new_tokens: int) -> dict:
    """tau, tau per draft position and pos1 of `proposer_for(i)` replayed on each prompt's reference."""
    from app.model.drafter_tau import per_position_acceptance
    from app.model.references import tau_on_greedy

    per: list[int] = []
    for i, (prompt, ref) in enumerate(zip(prompts, refs)):
        per += tau_on_greedy(proposer_for(i), prompt, ref, block_size, max_new_tokens)
    pos = per_position_acceptance(per, block_size)
    return {"tau": sum(per) / max(len(per), 1), "tau_pos": pos, "pos1": pos[0]}


def both_sets(proposer_on, work: dict, block_size: int = 0) -> dict:
    """`replay` on the held-out prompts and on the training sample; `proposer_on(prompt_set)` gives the
    per-prompt proposer factory for a set (`work["eval"]` or `work["fit"]`; a feature-free proposer ignores it).
    Blocks of `block_size` (default the drafter's, `work["block_size"]`)."""
    B, mx = block_size or work["block_size"], work["max_new_tokens"]
    ev, fit = work["eval"], work["fit"]
    held = replay(proposer_on(ev), ev["prompts"], ev["refs"], B, mx)
    train = replay(proposer_on(fit), fit["prompts"], fit["refs"], B, mx)
    return held | {"tau_train": train["tau"], "pos1_train": train["pos1"]}


def drafter_on(drafter, head):
    """A proposer factory of the drafter for a prompt set: per prompt, every block the replay can visit is
    drafted in one batched forward first (`app.model.health.block_hidden`: block j sees the features of the
    positions before its anchor, as speculative decoding's block does); a proposal reads its block's rows."""
    from app.model.health import block_hidden
    from app.model.spec_bench import LazyDrafts

    def on(prompt_set):
        def for_prompt(i):
            prompt, ref = list(prompt_set["prompts"][i]), list(prompt_set["refs"][i])
            first, text = len(prompt), prompt + ref
            anchors = list(range(first, len(text) - 1))  # every anchor the replay can visit
            if not anchors:
                return lambda prefix, count: []
            hidden = block_hidden(drafter, head, prompt_set["feats"][i].float(), text, anchors)
            return lambda prefix, count: LazyDrafts(head, hidden[len(prefix) - 1 - first, :count])

        return for_prompt

    return on


def hybrid_on(drafter, head):
    """Prompt lookup where the context has a match, the drafter's block otherwise (replayed at the references'
    block: a lookup match may run past the drafter's block, the drafter proposes its own block's rows)."""
    from app.model.references import prompt_lookup

    drafted = drafter_on(drafter, head)

    def on(prompt_set):
        def for_prompt(i):
            mine = drafted(prompt_set)(i)
            return lambda prefix, count: prompt_lookup(prefix, count) or mine(prefix, count)

        return for_prompt

    return on


def probe_drafter(drafter, head, work: dict, anchors: bool = True) -> dict:
    """Held-out and training replays of a drafter, its first guesses' spread and anchor sensitivity."""
    from app.model.health import anchor_sensitivity, collapse, first_guesses, spread

    drafter.eval()
    with torch.no_grad():
        out = both_sets(drafter_on(drafter, head), work)
        if anchors:
            ev = work["eval"]
            texts = [list(p) + list(r) for p, r in zip(ev["prompts"], ev["refs"])]
            spots = [spread(len(p), len(t) - 2, 32) for p, t in zip(ev["prompts"], texts)]
            feats = [f.float() for f in ev["feats"]]
            guesses = [first_guesses(drafter, head, f, t, a) for f, t, a in zip(feats, texts, spots)]
            out["first_top_share"] = collapse([g for gs in guesses for g in gs]).top_share
            out["anchor_sensitivity"] = anchor_sensitivity(drafter, head, feats, texts, spots, guesses_list=guesses)
    return out


def references(work: dict, plan) -> dict:
    """The training-free references on both prompt sets, at `work["ref_block"]` (at least 16: a smaller drafter
    block must not shorten what lookup and the tables may propose). The hybrid needs a trained drafter: each
    seed's is replayed where it is trained (`quality_real.train_and_measure`)."""
    from app.model.references import NgramDrafter, prompt_lookup_proposer

    seqs = [plan.dataset.sequence(i) for i in range(len(plan.dataset))]
    tables = {"bigram": NgramDrafter(seqs, n=1), "ngram": NgramDrafter(seqs, n=3)}
    R = work["ref_block"]
    out = {name: both_sets(lambda _f, t=t: (lambda i: t), work, R) for name, t in tables.items()}
    lookup = prompt_lookup_proposer(max_n=4, min_n=1)
    out["prompt_lookup"] = both_sets(lambda _f: (lambda i: lookup), work, R)
    return {name: r | {"block": R} for name, r in out.items()}
