"""The on-machine instruction prompt set (app/data/instruction_set.py; its files: python -m app.instructions):
every kind present, train and eval from disjoint sources, deterministic for a seed, written as records the data
readers and app.regenerate accept."""
from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from app import instructions as cmd
from app.data import instruction_set as ins


@pytest.fixture(scope="module")
def built() -> tuple[list, list]:
    return ins.build_instructions(192, 32, seed=0)


def test_every_kind_is_present_and_balanced(built) -> None:
    train, evals = built
    assert len(train) == 192 and len(evals) == 32
    for items, n in ((train, 192), (evals, 32)):
        kinds = collections.Counter(it.kind for it in items)
        assert set(kinds) == set(ins.KINDS)
        assert max(kinds.values()) - min(kinds.values()) <= 1, kinds  # the kinds take turns
        assert sum(kinds.values()) == n


def test_train_and_eval_come_from_disjoint_sources(built) -> None:
    train, evals = built
    train_keys = {ins.split_key(it.source) for it in train}
    eval_keys = {ins.split_key(it.source) for it in evals}
    assert train_keys and eval_keys and not train_keys & eval_keys
    assert not {it.text for it in train} & {it.text for it in evals}
    assert all(not ins.held_out(it.source) for it in train) and all(ins.held_out(it.source) for it in evals)
    # A package is one source: a submodule of a training package never lands in eval.
    assert ins.split_key("asyncio.tasks") == "asyncio" and ins.split_key("topic:del") == "topic:del"
    # Both kinds of source feed both sides (stdlib modules and reference topics).
    for items in (train, evals):
        assert any(it.source.startswith("topic:") for it in items)
        assert any(not it.source.startswith("topic:") for it in items)


def test_same_seed_same_set_other_seed_other_set(built) -> None:
    again = ins.build_instructions(192, 32, seed=0)
    assert again == built
    other = ins.build_instructions(192, 32, seed=1)
    assert [it.text for it in other[0]] != [it.text for it in built[0]]
    assert len({it.text for it in built[0]}) == 192  # no duplicate prompt


def test_sources_spread_and_prompts_stay_short(built) -> None:
    train, _ = built
    per_source = collections.Counter(it.source for it in train)
    per_kind_source = collections.Counter((it.kind, it.source) for it in train)
    # Within a kind no source repeats while others are unused: not one module's 90 functions.
    assert len(per_source) >= 100 and max(per_kind_source.values()) == 1
    assert max(len(it.text) for it in train) < ins.PASSAGE_CHARS + 400  # passage + the ask (~200 tokens)


def test_sample_refuses_more_than_there_is() -> None:
    import random

    pool = {"explain": (ins.Instruction("explain", "m", "a"),), "code": ()}
    with pytest.raises(ValueError, match="gives only 1"):
        ins.sample(pool, 2, random.Random(0))


def test_files_are_what_the_readers_take(tmp_path: Path) -> None:
    from app.data.formats import detect_format, iter_records, to_messages
    from app.data.regenerate import pending_records

    info = cmd.write_prompt_files(tmp_path, seed=0, num_train=20, num_eval=5)
    assert info["train"] == 20 and info["eval"] == 5 and sorted(p.name for p in tmp_path.iterdir()) == [
        "eval_prompts.jsonl", "prompts_train.jsonl"]
    for path in (info["train_file"], info["eval_file"]):
        for _, rec in iter_records(path):
            msgs = to_messages(rec, detect_format(rec, "auto"))
            assert [m["role"] for m in msgs] == ["user"] and msgs[0]["content"]
    todo, counts = pending_records(info["train_file"], "auto", "raise", set())
    assert len(todo) == 20 and all(m[-1]["role"] == "user" for _, m in todo)  # app.regenerate answers each
    first = json.loads(Path(info["train_file"]).read_text().splitlines()[0])
    assert first["kind"] in ins.KINDS and first["source"]
    # The same set again leaves the files alone (make smol regenerates only when the prompts changed).
    before = Path(info["train_file"]).stat().st_mtime_ns
    cmd.write_prompt_files(tmp_path, seed=0, num_train=20, num_eval=5)
    assert Path(info["train_file"]).stat().st_mtime_ns == before
    cmd.write_prompt_files(tmp_path, seed=0, num_train=21, num_eval=5)
    assert len(Path(info["train_file"]).read_text().splitlines()) == 21


def test_cut_passage_keeps_whole_paragraphs() -> None:
    text = "First para.\n\n" + "Second para. " * 10 + "\n\n" + "x" * 1000
    out = ins.cut_passage(text, 200)
    assert out.startswith("First para.\n\nSecond para.") and "x" not in out
    assert ins.cut_passage("One. " * 100, 100).endswith(".")  # a long first paragraph ends at a sentence
