"""Speculative decoding as a bench measures it: a drafter replayed on greedy output, and a speed race.

- `drafter_proposer`: a DFlash drafter as a `Proposer` for `app.model.references.tau_on_greedy`, reading
  the target's features of the whole greedy sequence (prompt + greedy output), computed once. Greedy
  speculative decoding is lossless, so every block spec decoding drafts has as context the features of
  exactly the greedy prefix before its anchor: the replay drafts the same blocks without a verify forward
  (the features come from one full forward instead of the KV-cached verifies: equal up to rounding).
  The n-gram table, prompt lookup and the drafter are then replayed on the same greedy references.
- `race`: what a user gets. Plain greedy decoding and speculative decoding with the drafter, both at
  batch 1 on the target's KV cache (`spec_generate` verifies a block per forward and crops the cache to
  the accepted prefix), on the same prompts, in one process, interleaved prompt by prompt (the order
  alternates, so a drift in machine load hits both), after the same warm-up; the outputs must be equal
  token for token.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from app.model.spec_decode import first_difference, greedy_reference, prefused, spec_generate


def drafter_proposer(drafter, head, feats_SD: torch.Tensor, block_size: int) -> Callable[[list[int], int], Sequence[int]]:
    """(prefix, count) -> the drafter's guesses after `prefix`'s last token (the anchor), with the features
    of every position before the anchor (`feats_SD`: features of a sequence that `prefix` is a prefix of).

    The same drafts as `draft_block`, computed more cheaply for a replay: the context is fused (`fc` + norm,
    a per-token map) once for the whole sequence, and each guess's LM-head row is computed only when read,
    so a block costs the rows up to its first miss instead of all B-1."""
    with torch.no_grad():
        fused_SH = drafter.fuse_context(feats_SD)

    def propose(prefix: list[int], count: int) -> Sequence[int]:
        anchor = len(prefix) - 1
        if anchor > fused_SH.shape[0]:
            raise ValueError(f"prefix of {len(prefix)} tokens is longer than the {fused_SH.shape[0]} featured positions")
        arch = drafter.arch
        ids = torch.full((1, block_size), arch.mask_token_id, dtype=torch.long, device=fused_SH.device)
        ids[0, 0] = prefix[-1]
        dtype = next(drafter.parameters()).dtype
        with torch.no_grad(), prefused(drafter):
            hidden = drafter(head.embed(ids).to(dtype), fused_SH[None, :anchor],
                             torch.tensor([[anchor]], device=fused_SH.device))
        return LazyDrafts(head, hidden[0, 1:1 + count])

    return propose


class LazyDrafts(Sequence):
    """A block's guesses, each the argmax of its LM-head row, computed on first read."""

    def __init__(self, head, hidden_QH: torch.Tensor) -> None:
        self.head, self.hidden, self.done = head, hidden_QH, {}

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return LazyDrafts(self.head, self.hidden[i])
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        if i not in self.done:
            with torch.no_grad():
                row = self.hidden[i:i + 1].to(self.head.lm_head.weight.dtype)
                self.done[i] = int(self.head.logits(row).argmax(dim=-1))
        return self.done[i]


@dataclass
class RaceResult:
    """Both decoders' time and tokens over the same prompts, and whether their outputs were identical."""

    greedy_s: float
    spec_s: float
    greedy_tokens: int
    spec_tokens: int
    identical: bool
    differing_prompts: list[int] = field(default_factory=list)  # indices of prompts whose outputs differ
    accepted_per_forward: list[int] = field(default_factory=list)  # spec decoding's tokens per verify forward

    @property
    def greedy_tok_s(self) -> float:
        return self.greedy_tokens / max(self.greedy_s, 1e-9)

    @property
    def spec_tok_s(self) -> float:
        return self.spec_tokens / max(self.spec_s, 1e-9)

    @property
    def speedup(self) -> float:
        """Speculative tokens/s over plain greedy tokens/s."""
        return self.spec_tok_s / max(self.greedy_tok_s, 1e-9)

    @property
    def tau(self) -> float:
        return sum(self.accepted_per_forward) / max(len(self.accepted_per_forward), 1)


@torch.no_grad()
def race(target, drafter, head, prompts: Sequence[Sequence[int]], max_new_tokens: int, layer_ids, block_size: int,
         eos_token_id: int | None = None, warmup: int = 1, clock: Callable[[], float] = time.perf_counter,
         outputs: list | None = None) -> RaceResult:
    """Greedy vs speculative decoding of every prompt at batch 1 (see the module docstring).

    `warmup` prompts (the first ones, cycled) run both ways untimed first. Prompt i runs greedy first when i
    is even, speculative first when odd. `outputs`, when given, receives each prompt's greedy tokens."""
    def greedy(p):
        return greedy_reference(target, list(p), max_new_tokens, eos_token_id)

    def spec(p):
        return spec_generate(target, drafter, head, list(p), max_new_tokens, layer_ids, block_size, eos_token_id)

    for k in range(warmup if prompts else 0):
        greedy(prompts[k % len(prompts)])
        spec(prompts[k % len(prompts)])
    res = RaceResult(0.0, 0.0, 0, 0, True)
    for i, prompt in enumerate(prompts):
        for kind in (("greedy", "spec") if i % 2 == 0 else ("spec", "greedy")):
            t0 = clock()
            out = greedy(prompt) if kind == "greedy" else spec(prompt)
            dt = clock() - t0
            if kind == "greedy":
                ref, res.greedy_s, res.greedy_tokens = out, res.greedy_s + dt, res.greedy_tokens + len(out)
            else:
                sres, res.spec_s, res.spec_tokens = out, res.spec_s + dt, res.spec_tokens + len(out.tokens)
        res.accepted_per_forward += sres.accepted_per_forward
        if first_difference(sres.tokens, ref) >= 0 or sres.verify_mismatches:
            res.identical = False
            res.differing_prompts.append(i)
        if outputs is not None:
            outputs.append(ref)
    return res
