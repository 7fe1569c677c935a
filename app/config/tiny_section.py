"""The `tiny` section: the built-in tiny target's size, corpus and training (used when
model.target == "tiny"), and the names the tiny target and its builder share with the config.
"""
from __future__ import annotations

from dataclasses import dataclass

from app.config.values import at_least, fail, one_of, positive

TINY_TARGET = "tiny"
# Token ids the tiny tokenizer reserves before its words (special tokens and role words);
# app/tiny/build.py asserts its vocabulary agrees.
TINY_RESERVED_TOKENS = 9
TINY_CORPORA = ("markov", "python")  # what the tiny target learns and generates its data from (app/tiny/)



@dataclass(frozen=True)
class TinyConfig:
    """Settings of the built-in tiny target (used when model.target == "tiny")."""

    cache_dir: str = ".cache/tiny"  # where the tiny target and its data are built once
    corpus: str = "markov"  # markov (a word cycle: fast, easy) | python (this interpreter's stdlib, BPE)
    hidden_size: int = 64
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512
    seed: int = 0
    num_train_prompts: int = 192
    num_eval_prompts: int = 8
    prompt_length: int = 12  # words per synthetic prompt
    response_length: int = 96  # tokens generated greedily per response
    chain_top_prob: float = 0.8  # the target is trained on a Markov chain: P(likely successor), rest = one other word
    chain_words: int = 128  # words on the chain's cycle that greedy text walks (0 = all); fewer = easier drafting
    lm_steps: int = 200  # AdamW steps that teach the target the chain before it generates the data (0 = random target)
    lm_batch_size: int = 8  # conversations per target training step
    lm_response_length: int = 48  # longest assistant turn (words) in the target's training conversations
    lm_lr: float = 1.0e-2  # target training peak learning rate

    def __post_init__(self) -> None:
        one_of("tiny.corpus", self.corpus, TINY_CORPORA)
        if self.corpus == "python" and self.vocab_size < 300:  # 256 byte tokens + 6 specials + merges
            fail("tiny.vocab_size", self.vocab_size, "is too small for tiny.corpus=python's byte-level BPE; use at least 300")
        words = self.vocab_size - TINY_RESERVED_TOKENS
        if words < 16:
            fail("tiny.vocab_size", self.vocab_size, "is too small; use at least 64")
        for key, value in (("tiny.hidden_size", self.hidden_size), ("tiny.num_heads", self.num_heads),
                           ("tiny.num_kv_heads", self.num_kv_heads), ("tiny.num_layers", self.num_layers),
                           ("tiny.intermediate_size", self.intermediate_size)):
            at_least(key, value, 1, "the tiny target needs it")
        if self.hidden_size % self.num_heads:
            fail("tiny.hidden_size", self.hidden_size, f"must be a multiple of tiny.num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            fail("tiny.num_heads", self.num_heads, f"must be a multiple of tiny.num_kv_heads={self.num_kv_heads}")
        at_least("tiny.num_train_prompts", self.num_train_prompts, 1, "the tiny target generates the training data")
        at_least("tiny.num_eval_prompts", self.num_eval_prompts, 0, "a count cannot be negative")
        at_least("tiny.prompt_length", self.prompt_length, 1, "a prompt needs a word")
        at_least("tiny.response_length", self.response_length, 4, "responses are at least a quarter of it")
        if not 0.5 < self.chain_top_prob <= 1.0:  # a range test: nan and inf fail it too
            fail("tiny.chain_top_prob", self.chain_top_prob, "must be in (0.5, 1] so greedy follows the chain")
        if not 0 <= self.chain_words <= words or self.chain_words == 1:
            fail("tiny.chain_words", self.chain_words, f"must be 0 (all) or in [2, {words}]")
        at_least("tiny.lm_steps", self.lm_steps, 0, "0 keeps the target random")
        at_least("tiny.lm_batch_size", self.lm_batch_size, 1, "a training step needs a conversation")
        at_least("tiny.lm_response_length", self.lm_response_length, 1, "a training answer needs a word")
        positive("tiny.lm_lr", self.lm_lr)
