"""Regenerating assistant turns with the target: the per-conversation logic and the OUT-file bookkeeping.

`python -m app.regenerate` (the entry point) spreads this over generator actors; this module holds no
Ray code, so the generator actor and the tests import it without the entry point.
"""
from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO


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


@dataclass(frozen=True)
class OutScan:
    """What OUT already holds: the ids written, complete lines that are not a record (skipped, counted),
    and the bytes of a torn last line (cut off)."""

    ids: frozenset[int]
    bad_lines: int = 0
    torn_bytes: int = 0


def scan_out(out_path: Path) -> OutScan:
    """Read OUT's ids. A complete line that is not a record (a bad edit, two old writers' interleaving)
    is skipped and counted, its record regenerated, and every line after it kept; only a torn last line
    (a crash mid-write, no newline) is cut off, so appends stay valid JSONL."""
    if not out_path.exists():
        return OutScan(frozenset())
    done: set[int] = set()
    bad, good_end = 0, 0
    with open(out_path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break  # torn mid-write: that record is regenerated
            good_end += len(line)
            try:
                done.add(int(json.loads(line)["id"]))
            except (ValueError, KeyError, TypeError, RecursionError):
                bad += 1
    torn = out_path.stat().st_size - good_end
    if torn:
        with open(out_path, "r+b") as f:
            f.truncate(good_end)
    return OutScan(frozenset(done), bad, torn)


def read_done_ids(out_path: Path) -> set[int]:
    """Ids already written to OUT (see `scan_out`)."""
    return set(scan_out(out_path).ids)


@contextmanager
def locked_out(out_path: Path) -> Iterator[TextIO]:
    """OUT opened for appending under an exclusive lock, held until the block ends: a second writer
    on the same OUT would interleave its lines with ours, so it is refused in one line instead."""
    from app.data.records import DataError

    with open(out_path, "a", encoding="utf-8") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError(f"{out_path} is being written by another python -m app.regenerate; wait for it to "
                            "end (it resumes where it stops) or give another --out") from None
        yield f


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
