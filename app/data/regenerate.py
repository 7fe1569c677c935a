"""Regenerating assistant turns with the target: the per-conversation logic and the OUT-file bookkeeping.

`python -m app.regenerate` (the entry point) spreads this over generator actors; this module holds no
Ray code, so the generator actor and the tests import it without the entry point.
"""
from __future__ import annotations

import json
from pathlib import Path


def regenerate_conversations(model, tokenizer, convs: list[list[dict]], *, max_new_tokens: int, max_length: int,
                             batch_size: int = 16, device: str = "cpu", enable_thinking: bool = False) -> list[list[dict]]:
    """Each conversation with every assistant turn regenerated greedily (and one appended if it ends on
    a user turn). Turns whose prompt already fills `max_length` end the conversation there."""
    from app.data.chat_mask import render
    from app.data.generate import greedy_generate

    stops = _stop_ids(model, tokenizer)
    work = [_turn_plan(c) for c in convs]  # per conversation: the non-assistant turns, in order
    done = [[] for _ in convs]  # rebuilt conversations
    cursor = [0] * len(convs)
    active = list(range(len(convs)))
    while active:
        prompts, limits, rows = [], [], []
        for c in active:
            plan = work[c]
            # Copy the user/system/tool turns up to the next assistant slot.
            while cursor[c] < len(plan) and plan[cursor[c]] is not None:
                done[c].append(plan[cursor[c]])
                cursor[c] += 1
            if cursor[c] >= len(plan):
                continue
            text = render(tokenizer, done[c], add_generation_prompt=True, enable_thinking=enable_thinking)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            room = min(max_new_tokens, max_length - len(ids))
            if room < 1:
                cursor[c] = len(plan)  # no room for a response: the conversation ends here
                continue
            prompts.append(ids)
            limits.append(room)
            rows.append(c)
        outs = greedy_generate(model, prompts, limits, pad_id=_pad_id(tokenizer), stop_ids=stops,
                               batch_size=batch_size, device=device)
        for c, out in zip(rows, outs):
            done[c].append({"role": "assistant", "content": tokenizer.decode(out, skip_special_tokens=True).strip()})
            cursor[c] += 1
        active = [c for c in rows if cursor[c] < len(work[c])]
    return [_drop_trailing_prompt_turns(d) for d in done]


def _turn_plan(messages: list[dict]) -> list[dict | None]:
    """The conversation with assistant turns replaced by None (slots to generate)."""
    plan: list[dict | None] = [None if m["role"] == "assistant" else dict(m) for m in messages]
    if plan and plan[-1] is not None:
        plan.append(None)  # ends on a user turn: generate the reply
    return plan


def _drop_trailing_prompt_turns(messages: list[dict]) -> list[dict]:
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    return messages


def _stop_ids(model, tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


# ----------------------------------------------------------------------------------- files


def read_done_ids(out_path: Path) -> set[int]:
    """Ids already written to OUT; a torn last line is cut off so appends stay valid JSONL."""
    if not out_path.exists():
        return set()
    done: set[int] = set()
    good_end = 0
    with open(out_path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break  # torn mid-write: that record is regenerated
            try:
                done.add(int(json.loads(line)["id"]))
            except (ValueError, KeyError, TypeError):
                break  # only the last line can be torn; nothing valid follows it
            good_end += len(line)
    if good_end < out_path.stat().st_size:
        with open(out_path, "r+b") as f:
            f.truncate(good_end)
    return done


def pending_records(in_path: str, data_format: str, on_error: str, done: set[int]) -> tuple[list[tuple[int, list[dict]]], dict]:
    """(id, messages) of the records of IN not yet in OUT, and counts of what was read."""
    from app.data.formats import detect_format, iter_records, to_messages
    from app.data.records import DataError, MalformedRecord

    counts = {"records": 0, "already_done": 0, "malformed": 0, "pending": 0}
    todo = []
    for line_no, rec in iter_records(in_path):
        counts["records"] += 1
        if line_no in done:
            counts["already_done"] += 1
            continue
        try:
            if isinstance(rec, MalformedRecord):
                raise rec
            fmt = detect_format(rec, data_format)
            if fmt == "tokenized":
                raise MalformedRecord("tokenized records have no text to regenerate")
            todo.append((line_no, to_messages(rec, fmt)))
        except MalformedRecord as e:
            if on_error == "raise":
                raise DataError(f"{in_path}:{line_no}: malformed record: {e}. Fix it or set data.on_error=skip") from None
            counts["malformed"] += 1
    counts["pending"] = len(todo)
    return todo, counts


def chunk_by_length(todo: list[tuple[int, list[dict]]], chunk_size: int) -> list[list[tuple[int, list[dict]]]]:
    """Chunks of records of similar text length, so each generator batch pads little."""
    ordered = sorted(todo, key=lambda r: (sum(len(m["content"]) for m in r[1]), r[0]))
    return [ordered[i : i + chunk_size] for i in range(0, len(ordered), chunk_size)]
