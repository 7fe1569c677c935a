"""`tiny.corpus: python`: a tiny target that speaks a real language, from text every Python install has.

The corpus is this interpreter's own standard library: every top-level module's source (comments and
docstrings included) plus its docstrings gathered on their own (prose beside the code). Modules are
split by name, not by line: every `HELD_OUT_EVERY`-th module (in sorted order) is held out, and the
eval prompts come only from those, so tau is measured on code the target never trained on and the
drafter never saw.

The build, deterministic for one interpreter (its version and the corpus digest key the cache):
  1. a byte-level BPE tokenizer (`tokenizers`) trained on the training modules, `tiny.vocab_size` rows,
     the tiny specials first (same ids as the markov tokenizer, `<|mask|>` reserved), ChatML template;
  2. the tiny Qwen3 target trained `tiny.lm_steps` AdamW steps on chat turns cut from the training
     text (user: a window of code, assistant: the text that follows it);
  3. train.jsonl: prompts cut from the training modules, responses the target's own greedy
     continuations (the regeneration path, `app.data.generate.greedy_generate`); eval_prompts.jsonl:
     prompts cut from the held-out modules.

What it is not: a model that writes good Python. A 64-wide, 6-layer target trained for seconds learns
the local statistics (indentation, keywords, common identifiers, repeated lines), so its greedy text
is partly repetitive; `python -m app.bench quality` reports how much of it copies the prompt.
"""
from __future__ import annotations

import ast
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

HELD_OUT_EVERY = 10  # every 10th module (sorted by name) is held out for eval prompts
MAX_CORPUS_CHARS = 2_000_000  # enough text for a 64-wide target; keeps tokenizer training to seconds
MAX_FILE_CHARS = 60_000  # a huge module (pydoc_data, unicode tables) would crowd out the rest
# Folders of the stdlib that are tests, tools or data rather than library code.
SKIP_DIRS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "dist-packages", "ensurepip",
             "lib2to3", "pydoc_data", "encodings", "__pycache__", "tkinter", "__phello__"}
PROMPT_TOKENS_PER_WORD = 4  # `tiny.prompt_length` counts words; a code prompt gets 4 BPE tokens per word


def stdlib_modules() -> list[Path]:
    """The interpreter's standard-library `.py` files, sorted by relative path (deterministic)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def docstrings(source: str) -> str:
    """The module's, classes' and functions' docstrings, blank-line separated ("" if it does not parse)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return "\n\n".join(d for n in nodes if (d := ast.get_docstring(n)))


def split_corpus() -> tuple[list[str], list[str]]:
    """(training documents, held-out documents): each module's source and its docstrings, capped."""
    train, held = [], []
    total = 0
    for i, path in enumerate(stdlib_modules()):
        try:
            source = path.read_text(encoding="utf-8")[:MAX_FILE_CHARS]
        except (OSError, UnicodeDecodeError):
            continue  # an unreadable file is not corpus
        docs = [source, docstrings(source)]
        (held if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).extend(d for d in docs if d.strip())
        total += len(source)
        if total >= MAX_CORPUS_CHARS:
            break
    if not train or not held:
        raise ValueError("tiny.corpus=python found no standard-library sources to train on; use tiny.corpus=markov")
    return train, held


def corpus_digest() -> str:
    """Interpreter version and the corpus's file list: part of the cache key, so another Python rebuilds."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names = [p.relative_to(root).as_posix() + f":{p.stat().st_size}" for p in stdlib_modules()]
    return hashlib.sha256(json.dumps([sys.version, names]).encode()).hexdigest()[:16]


def train_tokenizer(documents: list[str], vocab_size: int):
    """A byte-level BPE fast tokenizer with the tiny specials at ids 0..5 and the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from app.tiny.chat import BOS, CHATML_TEMPLATE, IM_END, IM_START, MASK, PAD, SPECIAL_TOKENS, UNK

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(documents, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token=UNK, pad_token=PAD, eos_token=IM_END,
                                  bos_token=BOS, mask_token=MASK, additional_special_tokens=[IM_START])
    tok.chat_template = CHATML_TEMPLATE
    if len(tok) != vocab_size:
        raise ValueError(f"tiny.vocab_size={vocab_size}: the BPE trainer made {len(tok)} tokens; use at least 300")
    return tok


def token_streams(tokenizer, documents: list[str]) -> list[np.ndarray]:
    """Each document's token ids (documents shorter than a few tokens dropped)."""
    out = [np.asarray(tokenizer(d, add_special_tokens=False)["input_ids"], dtype=np.int64) for d in documents]
    return [s for s in out if len(s) >= 16]


def windows(rng: np.random.Generator, streams: list[np.ndarray], count: int, length: int) -> list[np.ndarray]:
    """`count` random token windows of `length` (shorter where a document is shorter)."""
    out = []
    for _ in range(count):
        s = streams[int(rng.integers(len(streams)))]
        start = int(rng.integers(0, max(1, len(s) - length)))
        out.append(s[start:start + length])
    return out


def lm_conversations(rng, streams, tiny, tokenizer, count: int) -> list[tuple[list[int], list[int]]]:
    """Training conversations (ids, labels) for the target: user = a code window, assistant = what
    follows it in the module. Labels cover both turns' text (code is code in either), not the markup."""
    from app.tiny.train import IGNORE

    start, end = tokenizer.convert_tokens_to_ids("<|im_start|>"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    user_ids = tokenizer("user\n", add_special_tokens=False)["input_ids"]
    asst_ids = tokenizer("assistant\n", add_special_tokens=False)["input_ids"]
    n_prompt = tiny.prompt_length * PROMPT_TOKENS_PER_WORD
    out = []
    for w in windows(rng, streams, count, n_prompt + tiny.lm_response_length):
        user, resp = w[:n_prompt].tolist(), w[n_prompt:].tolist()
        head = [start, *user_ids]
        mid = [end, *tokenizer("\n", add_special_tokens=False)["input_ids"], start, *asst_ids]
        ids = head + user + mid + resp
        labels = [IGNORE] * len(head) + user + [IGNORE] * len(mid) + resp
        out.append((ids, labels))
    return out


def train_target(model, tokenizer, streams, tiny) -> list[float]:
    """`tiny.lm_steps` AdamW steps of next-token loss on code conversations (the markov schedule)."""
    from app.tiny.train import train_lm

    return train_lm(model, tokenizer, tiny, lambda rng: lm_conversations(rng, streams, tiny, tokenizer, tiny.lm_batch_size))


def prompt_texts(rng, streams, tokenizer, count: int, length: int) -> list[str]:
    """`count` prompts: token windows of about `length` tokens (+-50%), decoded to text."""
    lo, hi = max(4, length // 2), max(4, length + length // 2)
    out = []
    for _ in range(count):
        (w,) = windows(rng, streams, 1, int(rng.integers(lo, hi + 1)))
        out.append(tokenizer.decode(w.tolist()))
    return out


def build_python(tiny, root: Path, build_model, response_lengths) -> None:
    """The whole python-corpus build into `root` (model/, train.jsonl, eval_prompts.jsonl, lm_losses.json);
    `build_model` and `response_lengths` are app/tiny/build.py's (passed in: build imports this module)."""
    from app.data.generate import greedy_generate
    from app.tiny.chat import IM_START

    train_docs, held_docs = split_corpus()
    tokenizer = train_tokenizer(train_docs, tiny.vocab_size)
    train_streams, held_streams = token_streams(tokenizer, train_docs), token_streams(tokenizer, held_docs)
    model = build_model(tiny, tokenizer)
    if tiny.lm_steps:
        losses = train_target(model, tokenizer, train_streams, tiny)
        (root / "lm_losses.json").write_text(json.dumps([round(x, 4) for x in losses]) + "\n")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")

    rng = np.random.default_rng([tiny.seed, 1])
    n_prompt = tiny.prompt_length * PROMPT_TOKENS_PER_WORD
    train_prompts = prompt_texts(rng, train_streams, tokenizer, tiny.num_train_prompts, n_prompt)
    # The held-out prompts draw from their own stream: the same eval set whatever num_train_prompts is,
    # so taus at two data sizes compare on the same prompts (and the first N of a larger set are the N).
    eval_prompts = prompt_texts(np.random.default_rng([tiny.seed, 2]), held_streams, tokenizer,
                                tiny.num_eval_prompts, n_prompt)
    lengths = response_lengths(rng, tiny.num_train_prompts, tiny.response_length)
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                              add_generation_prompt=True) for p in train_prompts]
    prompt_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in rendered]
    special = sorted(set(tokenizer.all_special_ids) | {tokenizer.convert_tokens_to_ids(IM_START)})
    responses = greedy_generate(model, prompt_ids, lengths, pad_id=tokenizer.pad_token_id, suppress_ids=special,
                                batch_size=64)
    with open(root / "train.jsonl", "w") as f:
        for prompt, resp in zip(train_prompts, responses):
            msgs = [{"role": "user", "content": prompt},
                    {"role": "assistant", "content": tokenizer.decode(resp, skip_special_tokens=True)}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    with open(root / "eval_prompts.jsonl", "w") as f:
        for prompt in eval_prompts:
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt}]}) + "\n")
