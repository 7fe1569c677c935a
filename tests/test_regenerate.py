"""`app.regenerate`: assistant turns rewritten by the target, spread over generator actors, resumable."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from app.config.schema import Config, DataConfig, ModelConfig, TopologyConfig
from app.config.tiny_section import TinyConfig
from app.data.records import DataError
from app.data.regenerate import OutScan, locked_out, read_done_ids, regenerate_conversations, scan_out

SMALL = dict(num_layers=2, num_train_prompts=4, num_eval_prompts=1, prompt_length=4, response_length=8)

CONVS = [
    [{"role": "user", "content": "ba be bi"}, {"role": "assistant", "content": "old"},
     {"role": "user", "content": "bo bu"}, {"role": "assistant", "content": "old too"}],
    [{"role": "system", "content": "da"}, {"role": "user", "content": "de di do du"}],
    [{"role": "user", "content": "fa"}, {"role": "assistant", "content": "x"}],
]



@pytest.fixture(scope="module")
def tiny_cfg(tmp_path_factory):
    tiny = replace(TinyConfig(), cache_dir=str(tmp_path_factory.mktemp("tiny")), **SMALL)
    return Config(model=ModelConfig(target="tiny"), tiny=tiny,
                  data=replace(DataConfig(), max_length=40, on_error="skip"),
                  topology=replace(TopologyConfig(), num_targets=2, cpus_per_target=1, device="cpu"))


@pytest.fixture(scope="module")
def model_tok(tiny_cfg):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.tiny.build import ensure_tiny_target

    art = ensure_tiny_target(tiny_cfg.tiny)
    return AutoModelForCausalLM.from_pretrained(art.model_dir).eval(), AutoTokenizer.from_pretrained(art.model_dir)


@pytest.mark.slow
def test_every_assistant_turn_is_the_targets_greedy_reply(model_tok):
    from app.data.generate import greedy_generate

    model, tok = model_tok
    out = regenerate_conversations(model, tok, CONVS, max_new_tokens=6, max_length=40)
    assert [[m["role"] for m in c] for c in out] == [
        ["user", "assistant", "user", "assistant"], ["system", "user", "assistant"], ["user", "assistant"]]
    assert [m["content"] for m in out[0] if m["role"] == "user"] == ["ba be bi", "bo bu"]
    assert all(m["content"] not in ("old", "old too", "x") for c in out for m in c if m["role"] == "assistant")
    # The second turn sees the regenerated first one: regenerate it by hand and compare.
    prompt = tok.apply_chat_template(out[0][:3], tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    want = greedy_generate(model, [ids], 6, pad_id=tok.pad_token_id, stop_ids=[tok.eos_token_id])[0]
    assert out[0][3]["content"] == tok.decode(want, skip_special_tokens=True).strip()
    # Each turn is capped so prompt + response fits max_length.
    short = regenerate_conversations(model, tok, CONVS[:1], max_new_tokens=50, max_length=14)[0]
    full = tok.apply_chat_template(short, tokenize=False)
    assert len(tok(full, add_special_tokens=False)["input_ids"]) <= 14 + 2  # + trailing <|im_end|>, newline


def test_a_torn_last_line_is_cut_and_regenerated(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 1, "messages": []}\n{"id": 3, "messages": []}\n{"id": 5, "mess')
    assert read_done_ids(out) == {1, 3}
    assert out.read_text() == '{"id": 1, "messages": []}\n{"id": 3, "messages": []}\n'
    assert read_done_ids(tmp_path / "missing.jsonl") == set()


def test_a_bad_complete_line_is_skipped_and_counted_not_truncated_at(tmp_path):
    """Issue 22 item 8: a bad line in the middle cut off every finished record after it (ids 3 and 5
    here, regenerated for nothing and lost from OUT); now it is skipped and counted, only the torn tail goes."""
    out = tmp_path / "out.jsonl"
    body = '{"id": 1, "messages": []}\nnot json\n{"id": 3, "messages": []}\n[1]\n{"id": 5, "messages": []}\n'
    out.write_text(body + '{"id": 7, "me')
    assert scan_out(out) == OutScan(frozenset({1, 3, 5}), bad_lines=2, torn_bytes=len('{"id": 7, "me'))
    assert out.read_text() == body
    assert scan_out(out) == OutScan(frozenset({1, 3, 5}), bad_lines=2, torn_bytes=0)


def test_a_second_writer_on_one_out_is_refused(tmp_path):
    """Item 8: two runs on one OUT interleaved their lines; the second is refused in one line, in this
    process and from another process, and may write once the first is done."""
    import subprocess
    import sys

    out = tmp_path / "out.jsonl"
    probe = ("import sys; from pathlib import Path; from app.data.records import DataError\n"
             "from app.data.regenerate import locked_out\n"
             "try:\n    with locked_out(Path(sys.argv[1])): print('locked')\n"
             "except DataError as e: print('refused:', e)\n")
    with locked_out(out) as f:
        f.write('{"id": 1, "messages": []}\n')
        with pytest.raises(DataError, match="being written by another python -m app.regenerate"):
            with locked_out(out):
                pass
        other = subprocess.run([sys.executable, "-c", probe, str(out)], capture_output=True, text=True, check=True,
                               cwd=Path(__file__).resolve().parents[1])
        assert other.stdout.startswith(f"refused: {out} is being written by another python -m app.regenerate")
    again = subprocess.run([sys.executable, "-c", probe, str(out)], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parents[1])
    assert again.stdout == "locked\n" and read_done_ids(out) == {1}


@pytest.mark.ray
@pytest.mark.slow
def test_regenerate_over_actors_then_resume(ray_cluster, tiny_cfg, tmp_path):
    from app.regenerate import run_regenerate

    src = tmp_path / "in.jsonl"
    lines = [json.dumps({"messages": c}) for c in CONVS]
    lines.append(json.dumps({"conversations": [{"from": "human", "value": "ga ge"}, {"from": "gpt", "value": "y"}]}))
    lines.append("{broken")
    lines.append(json.dumps({"messages": [{"role": "user", "content": "ka ke ki"}]}))
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"

    counts = run_regenerate(tiny_cfg, str(src), str(out), max_new_tokens=6, chunk_size=2, batch_size=2)
    assert counts == {"records": 6, "already_done": 0, "malformed": 1, "pending": 5, "out_bad_lines": 0, "written": 5,
                      "given_up": 0}
    first = {r["id"]: r["messages"] for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(first) == [1, 2, 3, 4, 6]

    # Lose two records (one torn mid-write) and resume: only those are regenerated, identically.
    kept = [line for line in out.read_text().splitlines() if json.loads(line)["id"] not in (2, 6)]
    out.write_text("\n".join(kept) + "\n" + json.dumps({"id": 2, "messages": first[2]})[:15])
    again = run_regenerate(tiny_cfg, str(src), str(out), max_new_tokens=6, chunk_size=2, batch_size=2)
    assert again == {"records": 6, "already_done": 3, "malformed": 1, "pending": 2, "out_bad_lines": 0, "written": 2,
                     "given_up": 0}
    final = [json.loads(line) for line in Path(out).read_text().splitlines()]
    assert sorted(r["id"] for r in final) == [1, 2, 3, 4, 6]
    assert {r["id"]: r["messages"] for r in final} == first
