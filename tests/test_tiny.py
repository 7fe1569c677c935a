"""The tiny embedded target (app/tiny/build.py) and batched greedy generation (app/data/generate.py)."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from app.config.schema import Config, DataConfig, ModelConfig
from app.config.tiny_section import TinyConfig
from app.tiny.build import ensure_tiny_target, resolve_target, settings_hash

SMALL = dict(num_layers=2, num_train_prompts=12, num_eval_prompts=3, prompt_length=6, response_length=16,
             lm_steps=150, lm_response_length=24)



@pytest.fixture(scope="module")
def small(tmp_path_factory):
    tiny = replace(TinyConfig(), cache_dir=str(tmp_path_factory.mktemp("tiny")), **SMALL)
    return tiny, ensure_tiny_target(tiny)


@pytest.fixture(scope="module")
def loaded(small):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, art = small
    return AutoTokenizer.from_pretrained(art.model_dir), AutoModelForCausalLM.from_pretrained(art.model_dir).eval()


def _train_records(art):
    return [json.loads(line) for line in Path(art.train_file).read_text().splitlines()]


def test_artifacts_load_like_a_real_model(small, loaded):
    tiny, art = small
    tok, model = loaded
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == tiny.vocab_size == len(tok)
    assert not model.config.tie_word_embeddings
    assert art.mask_token_id == tok.mask_token_id
    assert art.mask_token_id not in (tok.pad_token_id, tok.eos_token_id) and 0 <= art.mask_token_id < len(tok)
    text = tok.apply_chat_template([{"role": "user", "content": "ba be"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nba be<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"]) == [
        "<|im_start|>", "user", "ba", "be", "<|im_end|>", "<|im_start|>", "assistant"]


def test_train_and_eval_files(small):
    tiny, art = small
    recs = _train_records(art)
    assert len(recs) == tiny.num_train_prompts
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in recs)
    resp_words = [len(r["messages"][1]["content"].split()) for r in recs]
    assert min(resp_words) >= tiny.response_length // 4 and max(resp_words) <= tiny.response_length * 7 // 4
    assert len(set(resp_words)) > 3  # lengths vary, so several buckets get data
    evals = [json.loads(line) for line in Path(art.eval_prompts_file).read_text().splitlines()]
    assert len(evals) == tiny.num_eval_prompts
    assert all([m["role"] for m in e["messages"]] == ["user"] for e in evals)


def test_responses_are_the_targets_greedy_continuations(small, loaded):
    import torch

    _, art = small
    tok, model = loaded
    for rec in _train_records(art)[:2]:
        prompt = tok.apply_chat_template(rec["messages"][:1], tokenize=False, add_generation_prompt=True)
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        want = tok(rec["messages"][1]["content"], add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            for t in want:  # teacher-forced argmax (specials excluded) reproduces every token
                logits = model(ids).logits[0, -1]
                logits[tok.all_special_ids + [tok.convert_tokens_to_ids("<|im_start|>")]] = float("-inf")
                assert int(logits.argmax()) == t
                ids = torch.cat([ids, torch.tensor([[t]])], dim=1)


def _chain_agreements(tiny, art):
    """Per response: share of words that are the chain's likely successor of the word before."""
    from transformers import AutoTokenizer

    from app.tiny.build import word_offset
    from app.tiny.train import chain_agreement, markov_chain

    tok = AutoTokenizer.from_pretrained(art.model_dir)
    chain = markov_chain(tiny, tiny.vocab_size - word_offset())
    out = []
    for rec in _train_records(art):
        prompt, resp = ([i - word_offset() for i in tok(m["content"], add_special_tokens=False)["input_ids"]]
                        for m in rec["messages"])
        out.append(chain_agreement(chain, prompt, resp))
    return out


def test_trained_target_follows_its_chain(small, tmp_path):
    tiny, art = small
    trained = _chain_agreements(tiny, art)
    # Chance is 1/503; a 2-layer target after 150 steps follows the likely successor almost always.
    assert sum(trained) / len(trained) > 0.8 and min(trained) > 0.5, trained
    losses = json.loads((Path(art.model_dir).parent / "lm_losses.json").read_text())
    assert len(losses) == tiny.lm_steps and losses[-1] < losses[0] / 3
    random_tiny = replace(tiny, cache_dir=str(tmp_path), num_train_prompts=4, lm_steps=0)
    untrained = _chain_agreements(random_tiny, ensure_tiny_target(random_tiny))
    assert max(untrained) < 0.1, untrained


def test_chain_is_one_long_cycle():
    import numpy as np

    from app.tiny.train import markov_chain

    for words in (0, 128):  # 0 = every word on the cycle
        chain = markov_chain(replace(TinyConfig(), chain_words=words), 500)
        on_cycle = set(chain.succ.tolist())
        assert len(on_cycle) == (words or 500)
        w = int(chain.succ[0])  # any word leads onto the cycle in one step ...
        seen = set()
        for _ in range(len(on_cycle)):  # ... and greedy text then never loops before visiting it all
            seen.add(w)
            w = int(chain.succ[w])
        assert w == int(chain.succ[0]) and seen == on_cycle
        assert not np.any(chain.alt == chain.succ) and chain.alt.min() >= 0 and chain.alt.max() < 500
        sample = chain.sample(np.random.default_rng(0), 7, 4000)
        prev = np.concatenate([[7], sample[:-1]])
        assert abs(np.mean(sample == chain.succ[prev]) - 0.8) < 0.03  # chain_top_prob


def test_batched_greedy_with_left_padding_matches_one_by_one(loaded):
    from app.data.generate import greedy_generate

    tok, model = loaded
    prompts = [[1, 7, 20 + i] + list(range(30, 30 + 2 * i)) + [2, 1, 8] for i in range(5)]
    limits = [3, 9, 1, 6, 12]
    batched = greedy_generate(model, prompts, limits, pad_id=tok.pad_token_id, batch_size=5)
    single = [greedy_generate(model, [p], n, pad_id=tok.pad_token_id)[0] for p, n in zip(prompts, limits)]
    assert batched == single
    assert [len(x) for x in batched] == limits  # nothing stops them: no stop ids given
    stop = batched[4][5]
    cut = greedy_generate(model, prompts[4:], 12, pad_id=tok.pad_token_id, stop_ids=[stop])[0]
    assert cut == batched[4][: batched[4].index(stop)]


def test_reuses_the_cache_and_keys_it_by_settings(small):
    tiny, art = small
    before = os.stat(art.train_file).st_mtime_ns
    again = ensure_tiny_target(tiny)
    assert again == art
    assert os.stat(art.train_file).st_mtime_ns == before  # not rebuilt: the cached files are untouched
    assert settings_hash(replace(tiny, cache_dir="elsewhere")) == settings_hash(tiny)
    assert settings_hash(replace(tiny, seed=1)) != settings_hash(tiny)


def test_losing_a_concurrent_build_race_uses_the_winner(tmp_path):
    tiny = replace(TinyConfig(), cache_dir=str(tmp_path), **{**SMALL, "num_train_prompts": 2, "lm_steps": 0})
    final = tmp_path / settings_hash(tiny)
    real_build = tmp_path / "real"
    ensure_tiny_target(replace(tiny, cache_dir=str(real_build)))  # what a real build leaves in its folder

    def racing_build(cfg, root):
        shutil.copytree(real_build / settings_hash(tiny), root)
        shutil.copytree(root, final)  # another process renames its build into place first
        (final / "winner").write_text("1")

    art = ensure_tiny_target(tiny, build=racing_build)
    assert Path(art.model_dir).parent == final and (final / "winner").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([final.name, "real"])  # the loser's temp folder is gone


def test_resolve_target():
    cfg = Config(model=ModelConfig(target="/models/qwen"), data=replace(DataConfig(), train_files=["a.jsonl"],
                                                                          eval_prompts="e.jsonl"))
    r = resolve_target(cfg)
    assert (r.model_dir, r.train_files, r.eval_prompts_file, r.mask_token_id) == (
        "/models/qwen", ["a.jsonl"], "e.jsonl", None)


def test_resolve_tiny_target(small):
    tiny, art = small
    r = resolve_target(Config(model=ModelConfig(target="tiny"), tiny=tiny))
    assert (r.model_dir, r.train_files, r.eval_prompts_file, r.mask_token_id) == (
        art.model_dir, [art.train_file], art.eval_prompts_file, art.mask_token_id)
    mine = resolve_target(Config(model=ModelConfig(target="tiny"), tiny=tiny,
                                 data=replace(DataConfig(), train_files=["mine.jsonl"])))
    assert mine.train_files == ["mine.jsonl"]


def test_bad_tiny_settings_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="tiny.hidden_size=66"):
        ensure_tiny_target(replace(TinyConfig(), cache_dir=str(tmp_path), hidden_size=66))
    with pytest.raises(ValueError, match="tiny.chain_words=9999"):
        ensure_tiny_target(replace(TinyConfig(), cache_dir=str(tmp_path), chain_words=9999))
    with pytest.raises(ValueError, match="tiny.chain_top_prob=0.5"):
        ensure_tiny_target(replace(TinyConfig(), cache_dir=str(tmp_path), chain_top_prob=0.5))
