"""Teach the tiny target a low-entropy language, so a drafter trained on its greedy output can learn.

A randomly initialised target's greedy text is an essentially random function of the whole context:
a drafter trained on it only learns "repeat the anchor". Instead the tiny build first trains the
target briefly (next-token loss, AdamW) on chat conversations whose assistant turns are sampled from
a sparse Markov chain over the word vocabulary:

    after word w comes succ[w] with probability `tiny.chain_top_prob`, else alt[w]

`succ` is one random cycle through `tiny.chain_words` words (the rest lead onto it), so greedy text
(which follows `succ`) never falls into a short loop: it walks the whole cycle, and held-out prompts
land on words the drafter has seen. A drafter must learn succ^k for k = 1..block_size-1: 128 cycle
words give tau 3.4-5.8 after the 6-epoch demo (tiny.seed 0-2); all ~500 words give 1.5-2.4. The
`alt` branch keeps the sampled text from being a pure copy of the cycle (the target learns a real
distribution whose argmax is `succ`). The assistant turn continues the chain from the last user word.

Everything is seeded from `tiny.seed`; the chain can be rebuilt from the settings alone (`markov_chain`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from app.config.tiny_section import TinyConfig

IGNORE = -100  # label of positions without a loss (the random user turn, the chat markup)


@dataclass(frozen=True)
class MarkovChain:
    """Successor tables over word indices (0 = first word after the special and role tokens)."""

    succ: np.ndarray  # [W] int: the likely successor (the greedy target follows it)
    alt: np.ndarray  # [W] int: the unlikely successor, never equal to succ
    top_prob: float  # probability of succ

    @property
    def num_words(self) -> int:
        return len(self.succ)

    def sample(self, rng: np.random.Generator, start: int, length: int) -> np.ndarray:
        """`length` words that follow word `start` (`start` itself not included)."""
        out = np.empty(length, dtype=np.int64)
        take_top = rng.random(length) < self.top_prob
        cur = start
        for i in range(length):
            cur = int(self.succ[cur] if take_top[i] else self.alt[cur])
            out[i] = cur
        return out


def markov_chain(tiny: TinyConfig, num_words: int) -> MarkovChain:
    """The build's chain: deterministic from `tiny.seed`.

    `succ` runs one cycle through `tiny.chain_words` random words (0 = all words); every other word's
    likely successor is a random word on the cycle, so greedy text enters the cycle after one word.
    """
    rng = np.random.default_rng([tiny.seed, 2])
    order = rng.permutation(num_words)
    cycle = order[: tiny.chain_words or num_words]
    succ = cycle[rng.integers(0, len(cycle), num_words)]
    succ[cycle] = np.roll(cycle, -1)
    alt = rng.integers(0, num_words - 1, num_words)
    alt = alt + (alt >= succ)  # uniform over the words other than succ
    return MarkovChain(succ=succ, alt=alt, top_prob=tiny.chain_top_prob)


def conversation_ids(
    rng: np.random.Generator, chain: MarkovChain, tiny: TinyConfig, ids: dict[str, int], word_offset: int
) -> tuple[list[int], list[int]]:
    """One training conversation as (input ids, labels), rendered like the tokenizer's ChatML template.

    The user turn is random words; the assistant turn continues the chain from the last user word.
    Labels cover the assistant words only: the user turn is noise and the markup is fixed.
    """
    lo, hi = max(1, tiny.prompt_length // 2), max(1, tiny.prompt_length + tiny.prompt_length // 2)
    user = rng.integers(0, chain.num_words, int(rng.integers(lo, hi + 1)))
    # Shorter than the greedy responses (cost); the rule is local, so it carries to later positions.
    resp_len = int(rng.integers(4, tiny.lm_response_length + 1))
    resp = chain.sample(rng, int(user[-1]), resp_len)
    head = [ids["im_start"], ids["user"], *(user + word_offset).tolist(), ids["im_end"],
            ids["im_start"], ids["assistant"]]
    body = (resp + word_offset).tolist()
    return head + body, [IGNORE] * len(head) + body


def train_on_chain(model, tokenizer, chain: MarkovChain, tiny: TinyConfig, word_offset: int) -> list[float]:
    """Train `model` in place for `tiny.lm_steps` AdamW steps on chain conversations; return the losses."""
    ids = {
        "im_start": tokenizer.convert_tokens_to_ids("<|im_start|>"),
        "im_end": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "user": tokenizer.convert_tokens_to_ids("user"),
        "assistant": tokenizer.convert_tokens_to_ids("assistant"),
    }
    return train_lm(model, tokenizer, tiny,
                    lambda rng: [conversation_ids(rng, chain, tiny, ids, word_offset) for _ in range(tiny.lm_batch_size)])


def train_lm(model, tokenizer, tiny: TinyConfig, batch: Callable[[np.random.Generator], list[tuple[list[int], list[int]]]]
             ) -> list[float]:
    """`tiny.lm_steps` AdamW steps of next-token loss on `batch(rng)`'s (input ids, labels) conversations,
    labels IGNORE where there is no loss; `model` is trained in place; returns the losses. Every corpus
    (markov, python) trains its target with this one schedule."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng([tiny.seed, 3])
    torch.manual_seed(tiny.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=tiny.lm_lr, weight_decay=0.0)
    # Linear warmup over the first 10% of steps, then linear decay: a short run still converges.
    warm = max(1, tiny.lm_steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.05, (tiny.lm_steps - s) / max(1, tiny.lm_steps - warm)))
    )
    pad = tokenizer.pad_token_id
    losses = []
    model.train()
    for _ in range(tiny.lm_steps):
        convs = batch(rng)
        width = max(len(x) for x, _ in convs)
        # Right padding: causal attention never lets a real token see the pads behind it.
        inp = torch.tensor([x + [pad] * (width - len(x)) for x, _ in convs])
        lab = torch.tensor([y + [IGNORE] * (width - len(y)) for _, y in convs])
        logits = model(input_ids=inp).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1),
                               ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def chain_agreement(chain: MarkovChain, prompt_words: list[int], response_words: list[int]) -> float:
    """Share of response words that are the chain's likely successor of the word before them."""
    prev = [prompt_words[-1], *response_words[:-1]]
    hits = sum(int(chain.succ[p]) == r for p, r in zip(prev, response_words))
    return hits / max(1, len(response_words))
