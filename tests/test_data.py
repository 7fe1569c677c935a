"""Readers and record formats (app/data/formats.py), chat-template loss masks, filters and counts (app/data/dataset.py); no Ray, no model."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from app.config.schema import DataConfig
from app.data.dataset import load_dataset, load_eval_prompts
from app.data.chat_mask import tokenize_conversation
from tests.chat_toys import (LLAMA_TEMPLATE, QWEN_TEMPLATE, QWEN_TEMPLATE_MARKED, THINKING_TEMPLATE, THREE_TURNS,
                             bpe_tokenizer)


@pytest.fixture(scope="module")
def qwen_tok():
    return bpe_tokenizer(QWEN_TEMPLATE)


def _masked_runs(tok, ids, mask) -> list[str]:
    """The text of each maximal run of masked tokens."""
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


@pytest.mark.parametrize("template,eot", [(QWEN_TEMPLATE, "<|im_end|>"), (QWEN_TEMPLATE_MARKED, "<|im_end|>"),
                                          (LLAMA_TEMPLATE, "<|eot_id|>")])
def test_three_turn_mask_covers_exactly_the_assistant_turns(template, eot):
    tok = bpe_tokenizer(template, eos=eot)
    ids, mask = tokenize_conversation(tok, THREE_TURNS)
    assert len(ids) == len(mask)
    # The ids are those of the rendered conversation; every assistant turn is one masked run of
    # exactly its content plus the end-of-turn token; nothing else is masked.
    full = tok.apply_chat_template(THREE_TURNS, tokenize=False)
    assert tok.decode(ids) == full
    expected = [m["content"] + eot for m in THREE_TURNS if m["role"] == "assistant"]
    assert _masked_runs(tok, ids, mask) == expected
    assert "You are Qwen" not in "".join(_masked_runs(tok, ids, mask))


def test_marker_and_prefix_paths_agree():
    plain, marked = bpe_tokenizer(QWEN_TEMPLATE), bpe_tokenizer(QWEN_TEMPLATE_MARKED)
    assert tokenize_conversation(plain, THREE_TURNS) == tokenize_conversation(marked, THREE_TURNS)


def test_history_rendered_differently_falls_back_to_content_search():
    # A template that tags only the final assistant turn (as Qwen3 does with think blocks): the
    # prefix renders are no prefixes of the full text, so spans come from locating the content.
    tmpl = QWEN_TEMPLATE.replace("message['content'] + '<|im_end|>", "(('[final] ' if loop.last else '') + message['content']) + '<|im_end|>")
    tok = bpe_tokenizer(tmpl)
    ids, mask = tokenize_conversation(tok, THREE_TURNS)
    runs = _masked_runs(tok, ids, mask)
    assert runs[:2] == ["Paris is the capital of France.<|im_end|>",
                        "Why did the cat sit on the computer? To keep an eye on the mouse!<|im_end|>"]
    assert runs[2].endswith("one two three four five six seven eight nine ten<|im_end|>")


def test_enable_thinking_reaches_the_template():
    tok = bpe_tokenizer(THINKING_TEMPLATE)
    prompt = [{"role": "user", "content": "Count from one to ten."}]
    for flag, has_block in ((False, True), (True, False)):
        text = tok.decode(load_eval_prompts_from(tok, prompt, flag))
        assert text.endswith("<think>\n\n</think>\n\n") == has_block
    # Training rendering gets the flag too: the think block never enters the loss mask.
    ids, mask = tokenize_conversation(tok, THREE_TURNS, enable_thinking=False)
    assert "think" not in "".join(_masked_runs(tok, ids, mask))


def load_eval_prompts_from(tok, messages, enable_thinking):
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".jsonl")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"messages": messages}) + "\n")
    try:
        return load_eval_prompts(path, tok, enable_thinking=enable_thinking)[0]
    finally:
        os.unlink(path)


def _write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def _cfg(**kw) -> DataConfig:
    return replace(DataConfig(), **{"max_length": 512, **kw})


def test_sharegpt_and_openai_give_identical_tokens(tmp_path, qwen_tok):
    speaker = {"user": "human", "assistant": "gpt", "system": "system"}
    sys_turn = [{"role": "system", "content": "You are a helpful assistant."}]
    convs = [THREE_TURNS, sys_turn + THREE_TURNS[:2]]
    oa = _write_jsonl(tmp_path / "oa.jsonl", [{"messages": c} for c in convs])
    sg = _write_jsonl(tmp_path / "sg.jsonl", [
        {"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in c]} for c in convs])
    a = load_dataset(_cfg(), 2, qwen_tok, [oa])
    b = load_dataset(_cfg(), 2, qwen_tok, [sg])
    assert len(a) == len(b) == 2
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    np.testing.assert_array_equal(a.offsets, b.offsets)
    assert a.tokens.dtype == np.int32 and a.loss_mask.dtype == np.uint8 and a.offsets.dtype == np.int64


def test_tokenized_records_and_parquet_reader(tmp_path, qwen_tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    recs = [{"input_ids": list(range(10 + i)), "loss_mask": [0] * 4 + [1] * (6 + i)} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "t.parquet")
    jl = _write_jsonl(tmp_path / "t.jsonl", recs)
    for path in (str(tmp_path / "t.parquet"), jl):
        ds = load_dataset(_cfg(format="tokenized"), 3, qwen_tok, [path])
        assert len(ds) == 3
        assert ds.lengths().tolist() == [10, 11, 12]
        ids, mask = ds.sequence(2)
        assert ids.tolist() == list(range(12)) and mask.tolist() == [0] * 4 + [1] * 8


def test_filters_are_counted_and_every_record_accounted(tmp_path, qwen_tok):
    long_answer = " ".join(["one two three four five six seven eight nine ten"] * 20)
    recs = [
        {"messages": THREE_TURNS},  # kept
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ten"}]},  # too few
        {"messages": [{"role": "user", "content": "count"}, {"role": "assistant", "content": long_answer}]},  # long
        {"input_ids": [1, 2, 3], "loss_mask": [1, 1]},  # malformed: lengths differ
        "{not json",  # malformed
        {"text": "no known keys"},  # malformed
    ]
    path = _write_jsonl(tmp_path / "mix.jsonl", recs)
    cfg = _cfg(max_length=160, on_error="skip")
    ds = load_dataset(cfg, 4, qwen_tok, [path])
    fs = ds.summary.files[path]
    assert (fs.records, fs.kept, fs.truncated) == (6, 2, 1)
    assert fs.dropped == {"too_few_loss_tokens": 1, "overlong": 0, "malformed": 3, "out_of_vocab": 0}
    assert fs.kept + sum(fs.dropped.values()) == fs.records
    assert ds.lengths().max() == 160  # truncated to max_length
    assert fs.tokens == int(ds.lengths().sum()) and fs.loss_tokens == int(ds.loss_mask.sum())

    dropped = load_dataset(replace(cfg, overlong="drop"), 4, qwen_tok, [path]).summary.total()
    assert dropped.dropped["overlong"] == 1 and dropped.kept == 1 and dropped.truncated == 0


def test_on_error_raise_names_file_and_line(tmp_path, qwen_tok):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": THREE_TURNS}, "", "{not json"])
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: malformed record.*on_error=skip"):
        load_dataset(_cfg(on_error="raise"), 2, qwen_tok, [path])
    sg = _write_jsonl(tmp_path / "who.jsonl", [{"conversations": [{"from": "alien", "value": "x"}]}])
    with pytest.raises(ValueError, match=r"who\.jsonl:1: .*unknown ShareGPT speaker 'alien'"):
        load_dataset(_cfg(), 2, qwen_tok, [sg])


def test_template_that_rejects_a_record_counts_it_as_malformed(tmp_path):
    strict = "{%- if messages[0]['role'] != 'user' -%}{{ raise_exception('first turn must be user') }}{%- endif -%}"
    tok = bpe_tokenizer(strict + QWEN_TEMPLATE)
    path = _write_jsonl(tmp_path / "r.jsonl", [{"messages": THREE_TURNS}, {"messages": THREE_TURNS[1:]}])
    ds = load_dataset(_cfg(on_error="skip"), 2, tok, [path])
    assert (len(ds), ds.summary.total().dropped["malformed"]) == (1, 1)
    with pytest.raises(ValueError, match=r"r\.jsonl:2: .*first turn must be user"):
        load_dataset(_cfg(), 2, tok, [path])


def test_bad_settings_and_paths_name_the_fix(tmp_path, qwen_tok):
    with pytest.raises(ValueError, match="data.overlong='cut'"):
        load_dataset(_cfg(overlong="cut"), 2, qwen_tok, [])
    with pytest.raises(ValueError, match="does not exist"):
        load_dataset(_cfg(), 2, qwen_tok, [str(tmp_path / "missing.jsonl")])


def test_eval_prompts_end_with_the_generation_prompt(tmp_path, qwen_tok):
    path = _write_jsonl(tmp_path / "eval.jsonl", [
        {"messages": THREE_TURNS[:2]},  # trailing assistant turn is dropped
        {"prompt": "Tell me a joke about cats."},
    ])
    prompts = load_eval_prompts(path, qwen_tok)
    assert len(prompts) == 2
    texts = [qwen_tok.decode(p) for p in prompts]
    assert texts[0].endswith("What is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert "Paris" not in texts[0]
    assert texts[1] == qwen_tok.apply_chat_template(
        [{"role": "user", "content": "Tell me a joke about cats."}], tokenize=False, add_generation_prompt=True)


# The assistant branch and generation prompt of Qwen3's template, as shipped: history turns render
# bare, turns after the last user query get a (possibly empty) think block, and enable_thinking=False
# puts an empty think block into the generation prompt.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_query_index=messages|length - 1) -%}"
    "{%- for message in messages[::-1] -%}{%- set index = (messages|length - 1) - loop.index0 -%}"
    "{%- if message.role == 'user' and ns.last_query_index == messages|length - 1 -%}"
    "{%- set ns.last_query_index = index -%}{%- endif -%}{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' or message.role == 'system' -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{%- if loop.index0 > ns.last_query_index and loop.last -%}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n\\n</think>\\n\\n' + message.content -}}"
    "{%- else -%}{{- '<|im_start|>' + message.role + '\\n' + message.content -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


@pytest.mark.parametrize("enable_thinking", [False, True])
def test_qwen3_style_template_masks_every_assistant_turn(enable_thinking):
    tok = bpe_tokenizer(QWEN3_TEMPLATE)
    # The user repeats the earlier answer: a naive content search would land in the user turn.
    convo = THREE_TURNS[:2] + [{"role": "user", "content": "Paris is the capital of France."},
                               {"role": "assistant", "content": "Paris is the capital of France."}]
    ids, mask = tokenize_conversation(tok, convo, enable_thinking=enable_thinking)
    runs = _masked_runs(tok, ids, mask)
    last = "Paris is the capital of France.<|im_end|>"
    # With thinking off, the empty think block is part of the prompt; with it on, the model writes it.
    assert runs == ["Paris is the capital of France.<|im_end|>",
                    last if not enable_thinking else "<think>\n\n</think>\n\n" + last]
    # Nothing of the user turns is masked.
    text = tok.decode(ids)
    user_start = text.index("<|im_start|>user\nParis")
    assert not any(m for m, o in zip(mask, _token_starts(tok, ids)) if user_start <= o < user_start + 40)


def _token_starts(tok, ids):
    starts, pos = [], 0
    for t in ids:
        starts.append(pos)
        pos += len(tok.decode([t]))
    return starts


def test_empty_assistant_turn_masks_nothing_for_it():
    tok = bpe_tokenizer(QWEN3_TEMPLATE)
    convo = [THREE_TURNS[0], {"role": "assistant", "content": ""}, THREE_TURNS[2], THREE_TURNS[3]]
    ids, mask = tokenize_conversation(tok, convo)
    assert _masked_runs(tok, ids, mask) == [THREE_TURNS[3]["content"] + "<|im_end|>"]
