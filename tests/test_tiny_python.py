"""tiny.corpus=python: the interpreter's stdlib, a BPE tokenizer, held-out modules, greedy responses."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.config.tiny_section import TinyConfig
from app.tiny.build import MASK, SPECIAL_TOKENS, ensure_tiny_target, settings_hash
from app.tiny.python_corpus import HELD_OUT_EVERY, split_corpus, stdlib_modules, train_tokenizer

SMALL = dict(corpus="python", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
             num_train_prompts=6, num_eval_prompts=3, prompt_length=6, response_length=12, lm_steps=5,
             lm_batch_size=2, lm_response_length=16)


@pytest.fixture(scope="module")
def corpus():
    return split_corpus()


def test_stdlib_split_holds_out_whole_modules(corpus):
    train, held = corpus
    assert len(train) > 10 * len(held) / HELD_OUT_EVERY and held
    assert not set(train) & set(held)  # no document on both sides
    names = [p.name for p in stdlib_modules()]
    assert names and not any(part in ("test", "idlelib") for p in stdlib_modules() for part in p.parts[-2:-1])
    assert any("def " in d for d in train) and any("\n\n" in d and "def " not in d for d in train)  # code and prose


def test_bpe_tokenizer_keeps_the_tiny_special_ids_and_round_trips(corpus):
    tok = train_tokenizer(corpus[0][:40], 400)
    assert len(tok) == 400
    assert tok.convert_ids_to_tokens(list(range(len(SPECIAL_TOKENS)))) == SPECIAL_TOKENS
    assert tok.mask_token_id == SPECIAL_TOKENS.index(MASK) and tok.eos_token == "<|im_end|>"
    code = "def area(self, r):\n    \"\"\"Circle area.\"\"\"\n    return 3.14 * r ** 2\n"
    ids = tok(code, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == code and len(ids) < len(code)  # merges learned, bytes round-trip
    chat = tok.apply_chat_template([{"role": "user", "content": code}], tokenize=False, add_generation_prompt=True)
    assert chat.startswith("<|im_start|>user\n") and chat.endswith("<|im_start|>assistant\n")
    assert train_tokenizer(corpus[0][:40], 400).backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()


@pytest.mark.slow  # a whole (small) build: BPE training, 5 target steps, generation (~10-30 s on 2 cores)
def test_python_corpus_build_loads_and_its_data_are_greedy_continuations(tmp_path, corpus):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny = TinyConfig(cache_dir=str(tmp_path), **SMALL)
    assert settings_hash(tiny) != settings_hash(TinyConfig(cache_dir=str(tmp_path), **(SMALL | {"corpus": "markov"})))
    art = ensure_tiny_target(tiny)
    root = Path(art.model_dir).parent
    tok = AutoTokenizer.from_pretrained(art.model_dir)
    model = AutoModelForCausalLM.from_pretrained(art.model_dir, dtype=torch.float32).eval()
    assert art.mask_token_id == tok.mask_token_id
    rows = [json.loads(line)["messages"] for line in open(art.train_file)]
    evals = [json.loads(line)["messages"] for line in open(art.eval_prompts_file)]
    assert len(rows) == 6 and len(evals) == 3 and all(len(m) == 1 for m in evals)
    held_text = "".join(corpus[1])
    assert all(m[0]["content"] in held_text for m in evals)  # eval prompts come from held-out modules
    # The first response is the target's own greedy continuation of its prompt.
    ids = tok.apply_chat_template(rows[0][:1], tokenize=False, add_generation_prompt=True)
    ids = tok(ids, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        first = model(input_ids=torch.tensor([ids])).logits[0, -1].argmax().item()
    resp = tok(rows[0][1]["content"], add_special_tokens=False)["input_ids"]
    assert tok.decode([first]) == tok.decode(resp)[: len(tok.decode([first]))]
    assert json.loads((root / "lm_losses.json").read_text())  # the target was trained first


def test_python_corpus_needs_room_for_byte_tokens():
    with pytest.raises(ValueError, match=r"tiny.vocab_size.*at least 300"):
        TinyConfig(corpus="python", vocab_size=256)
    with pytest.raises(ValueError, match="tiny.corpus"):
        TinyConfig(corpus="shakespeare")
