"""What a trained drafter's tau is measured against: reference drafters and how repetitive the text is.

Pure functions over token lists, no model: `python -m app.bench quality` feeds them the target's greedy
outputs on the held-out prompts (the tiny corpora and the real target alike).

- `tau_on_greedy`: tau of any proposer replayed against the target's greedy output. Greedy speculative
  decoding is lossless, so every verify forward's argmax is the greedy token at its slot; replaying a
  proposer over the greedy sequence gives exactly the tokens per forward `spec_generate` would (same
  first token from the prefill, same draft truncation at the token budget, same stop at EOS).
- `NgramDrafter`: the reference a learned drafter must beat: longest-suffix lookup (order `n` down to
  1) in a table of the training responses' continuations, its own guesses fed back for the block.
- `prompt_lookup`: the training-free reference engines ship (vLLM's n-gram proposer): the last n = 4..1
  tokens of prompt + output so far, matched at their most recent earlier occurrence; what followed it
  is the guess.
- `copy_shares`: the share of generated tokens whose trigram (the token and the two before it) occurs
  in the prompt, and in the prompt or the earlier output. A drafter that only learned to copy scores
  high where these are high; read tau next to them.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence

from app.model.spec_decode import accepted_prefix

Proposer = Callable[[list[int], int], Sequence[int]]  # (prefix ids, how many) -> up to that many guesses


def tau_on_greedy(propose: Proposer, prompt: Sequence[int], greedy: Sequence[int], block_size: int,
                  max_new_tokens: int) -> list[int]:
    """Tokens each verify forward would produce (accepted drafts + the target's token) for one prompt.

    `greedy` is plain greedy decoding's output for `prompt` (`greedy_reference`: at most
    `max_new_tokens`, ending early only at EOS, included)."""
    if not greedy:
        return []
    new = [greedy[0]]  # the prefill forward's token (not a verify forward)
    per_forward: list[int] = []
    while len(new) < len(greedy):
        want = min(block_size - 1, max_new_tokens - len(new) - 1, len(greedy) - len(new) - 1)
        # Sliced, not copied: a proposer may return a lazy sequence that computes a guess when it is read
        # (`accepted_prefix` reads them in order and stops at the first miss).
        drafts = propose(list(prompt) + new, block_size - 1)[: max(0, want)]
        slots = list(greedy[len(new): len(new) + len(drafts) + 1])  # each slot's verify argmax
        accepted = accepted_prefix(drafts, slots)
        new += slots[: accepted + 1]
        per_forward.append(accepted + 1)
    return per_forward


class NgramDrafter:
    """Next-token guesses by the longest matching context (order n..1) seen in the training responses."""

    def __init__(self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], n: int = 3) -> None:
        """`sequences`: (ids, loss mask) pairs; continuations are counted where the mask is set (responses)."""
        self.n = n
        counts: dict[tuple[int, ...], Counter] = defaultdict(Counter)
        for ids, mask in sequences:
            ids = [int(t) for t in ids]
            for i in range(1, len(ids)):
                if not mask[i]:
                    continue
                for k in range(1, n + 1):
                    if i - k >= 0:
                        counts[tuple(ids[i - k:i])][ids[i]] += 1
        # The most frequent continuation per context (ties to the smaller id: deterministic).
        self.table = {ctx: min(c.items(), key=lambda kv: (-kv[1], kv[0]))[0] for ctx, c in counts.items()}
        unigram = Counter(int(t) for ids, mask in sequences for t, m in zip(ids, mask) if m)
        self.fallback = min(unigram.items(), key=lambda kv: (-kv[1], kv[0]))[0] if unigram else 0

    def next_token(self, ids: Sequence[int]) -> int:
        for k in range(min(self.n, len(ids)), 0, -1):
            hit = self.table.get(tuple(ids[-k:]))
            if hit is not None:
                return hit
        return self.fallback

    def __call__(self, prefix: list[int], count: int) -> list[int]:
        ids, out = list(prefix), []
        for _ in range(count):
            out.append(self.next_token(ids))
            ids.append(out[-1])
        return out


def prompt_lookup(context: Sequence[int], count: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to `count` guesses: the tokens that followed the most recent earlier occurrence of the context's
    last n tokens, for the largest n in max_n..min_n that occurs; [] when none does.

    The match may overlap the suffix itself (a run of one token proposes more of it); the guesses stop
    where the context ends, so fewer than `count` may come back."""
    ids = list(context)
    end = len(ids)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        suffix = ids[end - n:]
        for start in range(end - n - 1, -1, -1):  # most recent first; the suffix's own place excluded
            if ids[start:start + n] == suffix:
                return ids[start + n:start + n + count]
    return []


def prompt_lookup_proposer(max_n: int = 4, min_n: int = 1) -> Proposer:
    """`prompt_lookup` as a `Proposer` for `tau_on_greedy`."""
    return lambda prefix, count: prompt_lookup(prefix, count, max_n, min_n)


def copy_shares(prompt: Sequence[int], generated: Sequence[int]) -> tuple[int, int, int]:
    """(tokens, copies of the prompt, copies of the prompt or earlier output), by trigram membership."""
    ctx = list(prompt)
    in_prompt = {tuple(ctx[i:i + 3]) for i in range(len(ctx) - 2)}
    seen = set(in_prompt)
    from_prompt = from_context = 0
    for t in generated:
        ctx.append(int(t))
        gram = tuple(ctx[-3:])
        from_prompt += gram in in_prompt
        from_context += gram in seen
        seen.add(gram)
    return len(generated), from_prompt, from_context
