"""The built-in tiny target (`model.target: tiny`): a small random Qwen3 model, a local tokenizer, data.

Everything is built offline from `TinyConfig` with a fixed seed, once, into
`tiny.cache_dir/<hash of the settings>/`, and reused. The build writes into a temp folder and renames
it into place, so concurrent or interrupted builds never leave a half-written cache.

Layout of a build:
    model/            Qwen3ForCausalLM + tokenizer, loadable with Auto*.from_pretrained
    train.jsonl       {"messages": [user, assistant]} per line; the response is the target's own
                      greedy continuation, so a drafter has something real to learn
    eval_prompts.jsonl {"messages": [{"role": "user", "content": ...}]} per line (no assistant turn)
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from app.config.schema import Config
from app.config.tiny_section import TINY_RESERVED_TOKENS, TINY_TARGET, TinyConfig
# The special tokens and the chat template are shared with the python corpus (app/tiny/python_corpus.py).
from app.tiny.chat import BOS, CHATML_TEMPLATE, IM_END, IM_START, MASK, PAD, ROLE_WORDS, SPECIAL_TOKENS, UNK

# Bump when the builder changes what it writes, so old caches are not reused.
BUILD_VERSION = 3  # 3: the target is trained on a Markov chain before it generates the data
# Weight init std of the random target. HF's 0.02 makes a tiny model's greedy output collapse into
# one repeated token; 0.3 makes it near-random. 0.1 gives context-dependent, partly repetitive text.
INIT_STD = 0.1
PYTHON_BUILD_VERSION = 2  # 2: the held-out prompts no longer depend on num_train_prompts

@dataclass(frozen=True)
class TinyArtifacts:
    """Paths and ids of one tiny-target build."""

    model_dir: str
    train_file: str  # JSONL, OpenAI `messages` (user + assistant)
    eval_prompts_file: str  # JSONL, `{"messages": [{"role": "user", ...}]}` per line
    mask_token_id: int  # `<|mask|>`: a real embedding row, neither pad nor eos


@dataclass(frozen=True)
class ResolvedTarget:
    """Where the target model and its data live, whatever `model.target` says."""

    model_dir: str
    train_files: list[str]
    eval_prompts_file: str
    mask_token_id: int | None  # the tiny target's `<|mask|>` row (None for others), for summaries: runs take
    # the mask id from the tokenizer (app.config.checks.resolved_mask_token_id), which names the same row


def settings_hash(tiny: TinyConfig) -> str:
    """Cache key: every setting that shapes the build (not where it is cached)."""
    settings = {k: v for k, v in asdict(tiny).items() if k != "cache_dir"}
    if tiny.corpus == "markov":
        del settings["corpus"]  # the key came later: markov builds keep the cache key they had
    else:  # the corpus is this interpreter's stdlib: another Python (or another stdlib) builds anew
        from app.tiny.python_corpus import corpus_digest

        settings["_corpus_digest"] = corpus_digest()
        settings["_python_build"] = PYTHON_BUILD_VERSION
    settings["_build_version"] = BUILD_VERSION
    settings["_init_std"] = INIT_STD
    blob = json.dumps(settings, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def ensure_tiny_target(tiny: TinyConfig, build=None) -> TinyArtifacts:
    """Build the tiny target and its data once (atomically) and return where they are. `build(tiny, folder)`
    (default: the real build) fills the temp folder; a test passes one that loses the rename race."""
    final = Path(tiny.cache_dir) / settings_hash(tiny)
    if not final.exists():
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            (build or _build)(tiny, tmp)
            try:
                os.rename(tmp, final)
            except OSError:
                # Another process finished the same build first; its result is identical.
                if not final.exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _artifacts(final)


def resolve_target(cfg: Config) -> ResolvedTarget:
    """For target=tiny build/reuse the tiny artifacts (config paths still win); else pass paths on."""
    if cfg.model.target != TINY_TARGET:
        from app.config.gguf_names import is_gguf_target
        from app.model.gguf_target import converted_dir

        # A GGUF target (a .gguf file or the embedded SmolLM2) is converted once to an HF folder; every consumer
        # then loads that folder as it loads any HF target.
        model_dir = str(converted_dir(cfg.model.target)) if is_gguf_target(cfg.model.target) else cfg.model.target
        return ResolvedTarget(
            model_dir=model_dir,
            train_files=list(cfg.data.train_files),
            eval_prompts_file=cfg.data.eval_prompts,
            mask_token_id=None,
        )
    art = ensure_tiny_target(cfg.tiny)
    return ResolvedTarget(
        model_dir=art.model_dir,
        train_files=list(cfg.data.train_files) or [art.train_file],
        eval_prompts_file=cfg.data.eval_prompts or art.eval_prompts_file,
        mask_token_id=art.mask_token_id,
    )


def _artifacts(root: Path) -> TinyArtifacts:
    return TinyArtifacts(
        model_dir=str(root / "model"),
        train_file=str(root / "train.jsonl"),
        eval_prompts_file=str(root / "eval_prompts.jsonl"),
        mask_token_id=SPECIAL_TOKENS.index(MASK),
    )


def synthetic_words(count: int) -> list[str]:
    """`count` distinct pronounceable words (consonant-vowel syllables), deterministic.

    One- and two-syllable words first (4,970; small vocabularies get exactly these), then three-syllable
    ones, so a real-sized vocabulary (151,936 for conf/medium.yaml) has a word per row."""
    import itertools

    cons, vows = "bdfgklmnprstvz", "aeiou"
    syll = [c + v for c in cons for v in vows]
    shapes = itertools.chain(syll, (a + b for a in syll for b in syll),
                             (a + b + c for a in syll for b in syll for c in syll))
    words = list(itertools.islice(shapes, count))
    if len(words) < count:
        raise ValueError(f"tiny.vocab_size asks for {count} words; at most {len(words)} exist")
    return words


def build_tokenizer(vocab_size: int):
    """A word-level fast tokenizer with ChatML specials and a reserved `<|mask|>` row."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = synthetic_words(vocab_size - len(SPECIAL_TOKENS) - len(ROLE_WORDS))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + ROLE_WORDS + words)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token=UNK,
        pad_token=PAD,
        eos_token=IM_END,
        bos_token=BOS,
        mask_token=MASK,
        additional_special_tokens=[IM_START],
    )
    tok.chat_template = CHATML_TEMPLATE
    assert len(tok) == vocab_size, (len(tok), vocab_size)
    return tok


def build_model(tiny: TinyConfig, tokenizer):
    """A randomly initialised Qwen3ForCausalLM from the tiny settings (seeded)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=tiny.vocab_size,
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_kv_heads,
        head_dim=tiny.hidden_size // tiny.num_heads,
        max_position_embeddings=4096,
        initializer_range=INIT_STD,
        tie_word_embeddings=False,  # drafters load embed_tokens and lm_head separately
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(tiny.seed)
    return Qwen3ForCausalLM(cfg).eval()


def _prompts(rng: np.random.Generator, words: list[str], count: int, length: int) -> list[str]:
    """Random word prompts whose lengths vary by +-50% around `length`."""
    lo, hi = max(1, length // 2), max(1, length + length // 2)
    out = []
    for _ in range(count):
        n = int(rng.integers(lo, hi + 1))
        out.append(" ".join(words[int(j)] for j in rng.integers(0, len(words), n)))
    return out


def response_lengths(rng: np.random.Generator, count: int, length: int) -> list[int]:
    """Per-response token counts, uniform in [length/4, 7*length/4], so several buckets fill."""
    return [int(x) for x in rng.integers(max(4, length // 4), length * 7 // 4 + 1, count)]


def word_offset() -> int:
    """Token id of the first synthetic word (words follow the special and role tokens)."""
    assert len(SPECIAL_TOKENS) + len(ROLE_WORDS) == TINY_RESERVED_TOKENS  # TinyConfig's checks count on it
    return TINY_RESERVED_TOKENS


def _build(tiny: TinyConfig, root: Path) -> None:
    import torch

    root.mkdir(parents=True)
    # One thread: the steps are tiny, and on a shared 2-core machine two threads run ~20x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if tiny.corpus == "python":
            from app.tiny.python_corpus import build_python

            build_python(tiny, root, build_model, response_lengths)
        else:
            _build_markov(tiny, root)
    finally:
        torch.set_num_threads(threads)
    (root / "settings.json").write_text(json.dumps(asdict(tiny), sort_keys=True, indent=1) + "\n")


def _build_markov(tiny: TinyConfig, root: Path) -> None:
    """The markov corpus: a word tokenizer, the target taught the chain, its greedy text as data."""
    tokenizer = build_tokenizer(tiny.vocab_size)
    model = build_model(tiny, tokenizer)
    if tiny.lm_steps:
        from app.tiny.train import markov_chain, train_on_chain

        chain = markov_chain(tiny, tiny.vocab_size - word_offset())
        losses = train_on_chain(model, tokenizer, chain, tiny, word_offset())
        (root / "lm_losses.json").write_text(json.dumps([round(x, 4) for x in losses]) + "\n")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    _write_data(tiny, root, model, tokenizer)


def _write_data(tiny: TinyConfig, root: Path, model, tokenizer) -> None:
    """train.jsonl (random prompts + the target's greedy responses) and eval_prompts.jsonl."""
    from app.data.generate import greedy_generate

    rng = np.random.default_rng([tiny.seed, 1])
    words = synthetic_words(tiny.vocab_size - word_offset())
    train_prompts = _prompts(rng, words, tiny.num_train_prompts, tiny.prompt_length)
    eval_prompts = _prompts(rng, words, tiny.num_eval_prompts, tiny.prompt_length)
    lengths = response_lengths(rng, tiny.num_train_prompts, tiny.response_length)

    prompt_ids = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in train_prompts
    ]
    prompt_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompt_ids]
    # Special ids are suppressed so every response decodes to words and re-tokenizes identically.
    special = sorted(set(tokenizer.all_special_ids) | {tokenizer.convert_tokens_to_ids(IM_START)})
    responses = greedy_generate(
        model, prompt_ids, lengths, pad_id=tokenizer.pad_token_id, suppress_ids=special, batch_size=64
    )
    with open(root / "train.jsonl", "w") as f:
        for prompt, resp in zip(train_prompts, responses):
            text = tokenizer.decode(resp, skip_special_tokens=True)
            msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": text}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    with open(root / "eval_prompts.jsonl", "w") as f:
        for prompt in eval_prompts:
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt}]}) + "\n")
