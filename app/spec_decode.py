"""Greedy speculative decoding with a DFlash drafter, and the acceptance length tau.

Each step drafts one block from the last accepted token ([token, MASK x (B-1)]) with the target
features of every accepted position before it, verifies the block with one target forward, and
accepts the longest prefix the target agrees with plus the target's own next token. The output is
the target's greedy output token for token, whatever the drafter predicts.

No KV cache: every target forward reads the whole sequence (correctness first; the tiny targets
used here make that cheap). The greedy baseline does the same, so tokens/s compare like for like.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from app.model.features import features_from_hidden_states


@dataclass
class SpecResult:
    """Generated tokens (prompt excluded) and how many tokens each verify forward produced."""

    tokens: list[int]
    target_forwards: int  # verify forwards (the prefill forward is not counted)
    accepted_per_forward: list[int] = field(default_factory=list)  # accepted drafts + 1 bonus


@dataclass
class EvalResult:
    """tau = mean tokens per verify forward (bonus included); tokens/s of spec and plain greedy."""

    tau: float
    tok_s: float
    greedy_tok_s: float
    speedup: float
    num_prompts: int
    new_tokens: int
    target_forwards: int
    matches_greedy: bool


def _target_step(target_model, ids: list[int], layer_ids):
    """One full forward: (greedy next token at every position [L], features [L, k*H])."""
    dev = next(target_model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=dev)
    out = target_model(input_ids=x, output_hidden_states=layer_ids is not None, use_cache=False)
    greedy = out.logits[0].argmax(dim=-1)
    feats = None if layer_ids is None else features_from_hidden_states(out.hidden_states, layer_ids)[0]
    return greedy, feats


@torch.no_grad()
def greedy_generate(target_model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """Plain greedy decoding, one full target forward per token (the reference for spec_generate)."""
    ids = list(prompt_ids)
    new: list[int] = []
    while len(new) < max_new_tokens:
        greedy, _ = _target_step(target_model, ids, None)
        tok = int(greedy[-1])
        ids.append(tok)
        new.append(tok)
        if tok == eos_token_id:
            break
    return new


@torch.no_grad()
def draft_block(drafter, head, context_feats_SD: torch.Tensor, anchor_token: int, block_size: int) -> list[int]:
    """The drafter's greedy guesses for positions anchor+1 .. anchor+B-1 (anchor at position S)."""
    arch = drafter.arch
    dev = context_feats_SD.device
    ids = torch.full((1, block_size), arch.mask_token_id, dtype=torch.long, device=dev)
    ids[0, 0] = anchor_token
    dtype = next(drafter.parameters()).dtype
    S = context_feats_SD.shape[0]
    hidden = drafter(head.embed(ids).to(dtype), context_feats_SD[None], torch.tensor([[S]], device=dev))
    logits = head.logits(hidden[0, 1:].to(head.lm_head.weight.dtype))
    return logits.argmax(dim=-1).tolist()


@torch.no_grad()
def spec_generate(
    target_model,
    drafter,
    head,
    prompt_ids: list[int],
    max_new_tokens: int,
    layer_ids,
    block_size: int,
    eos_token_id: int | None = None,
) -> SpecResult:
    """Greedy speculative decoding; the tokens equal `greedy_generate`'s."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty; speculative decoding needs at least one prompt token")
    greedy, feats = _target_step(target_model, list(prompt_ids), layer_ids)
    ids = list(prompt_ids) + [int(greedy[-1])]
    context = feats  # features of every position before the last (anchor) token
    new = [ids[-1]]
    result = SpecResult(tokens=new, target_forwards=0)
    while len(new) < max_new_tokens and new[-1] != eos_token_id:
        n = len(ids) - 1  # anchor position
        drafts = draft_block(drafter, head, context, ids[-1], block_size)
        drafts = drafts[: max_new_tokens - len(new) - 1]  # the bonus token fills the last slot
        greedy, feats = _target_step(target_model, ids + drafts, layer_ids)
        # greedy[n + i] is the target's token for position n + i + 1, the slot of drafts[i].
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == int(greedy[n + accepted]):
            accepted += 1
        produced = drafts[:accepted] + [int(greedy[n + accepted])]
        if eos_token_id is not None and eos_token_id in produced:
            produced = produced[: produced.index(eos_token_id) + 1]
        produced = produced[: max_new_tokens - len(new)]
        ids += produced
        new += produced
        context = feats[: len(ids) - 1]  # accepted positions only; the new anchor has none yet
        result.target_forwards += 1
        result.accepted_per_forward.append(len(produced))
    return result


def measure_tau(
    target_model,
    drafter,
    head,
    prompts: list[list[int]],
    max_new_tokens: int,
    layer_ids,
    block_size: int,
    eos_token_id: int | None = None,
    baseline: bool = True,
) -> EvalResult:
    """Run spec (and, with `baseline`, plain greedy) decoding on every prompt; tau and tokens/s.

    Without the baseline, greedy_tok_s/speedup are 0 and matches_greedy is not checked (True).
    """
    spec_s = greedy_s = 0.0
    new_tokens = forwards = accepted = 0
    same = True
    for prompt in prompts:
        t0 = time.perf_counter()
        res = spec_generate(target_model, drafter, head, prompt, max_new_tokens, layer_ids, block_size, eos_token_id)
        t1 = time.perf_counter()
        if baseline:
            same &= res.tokens == greedy_generate(target_model, prompt, max_new_tokens, eos_token_id)
        spec_s += t1 - t0
        greedy_s += time.perf_counter() - t1
        new_tokens += len(res.tokens)
        forwards += res.target_forwards
        accepted += sum(res.accepted_per_forward)
    tok_s = new_tokens / max(spec_s, 1e-9)
    greedy_tok_s = new_tokens / greedy_s if baseline else 0.0
    return EvalResult(
        tau=accepted / max(forwards, 1),
        tok_s=tok_s,
        greedy_tok_s=greedy_tok_s,
        speedup=tok_s / max(greedy_tok_s, 1e-9),
        num_prompts=len(prompts),
        new_tokens=new_tokens,
        target_forwards=forwards,
        matches_greedy=same,
    )
