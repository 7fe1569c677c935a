"""Record formats: reading a file's records, telling their format apart, parsing one into tokens.

Formats (per record with `data.format: auto`):
- openai:    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}, ...]}
- sharegpt:  {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}, ...]}
             mapped to the same roles, so it tokenizes identically to openai
- tokenized: {"input_ids": [...], "loss_mask": [...]} used as is

The loss mask covers the tokens of every assistant turn (content and end-of-turn token), nothing
else. Templates with `{% generation %}` markers use HF's assistant mask; others derive the spans by
rendering conversation prefixes (see `app/data/chat_mask.py`). A record that cannot be parsed raises
`MalformedRecord` (`app/data/records.py`); what a run does with it is `app/data/dataset.py`'s business.
"""
from __future__ import annotations

from collections.abc import Iterator

from app.data.chat_mask import tokenize_conversation
from app.data.records import MalformedRecord, OutOfVocab
from app.data.shards import read_shard, whole_file

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


def iter_records(path: str) -> Iterator[tuple[int, dict | MalformedRecord]]:
    """(line number from 1, record or MalformedRecord) for a .jsonl/.json or .parquet file."""
    for shard in whole_file(path):
        yield from read_shard(shard)


def detect_format(rec: dict, fmt: str) -> str:
    """The record's format: `fmt` itself unless it is auto."""
    if fmt != "auto":
        return fmt
    # `is not None`: Parquet files with mixed schemas carry every column, null where unused.
    if rec.get("messages") is not None:
        return "openai"
    if rec.get("conversations") is not None:
        return "sharegpt"
    if rec.get("input_ids") is not None:
        return "tokenized"
    raise MalformedRecord(f"no messages/conversations/input_ids key (keys: {sorted(rec)[:8]})")


def to_messages(rec: dict, fmt: str) -> list[dict]:
    """OpenAI-style [{"role", "content"}] from an openai or sharegpt record."""
    if fmt == "openai":
        return [{"role": role, "content": text} for role, text in _turns(rec, "messages", "role", "content", "each message")]
    out = []
    for speaker, text in _turns(rec, "conversations", "from", "value", "each conversation turn"):
        role = SHAREGPT_ROLES.get(speaker.lower())
        if role is None:
            raise MalformedRecord(f"unknown ShareGPT speaker {speaker!r}")
        out.append({"role": role, "content": text})
    return out


def _turns(rec: dict, key: str, who: str, what: str, name: str) -> list[tuple[str, str]]:
    """(speaker, text) of every turn under `key`: a non-empty list of objects with string `who` and `what`."""
    turns = rec.get(key)
    if not isinstance(turns, list) or not turns:
        raise MalformedRecord(f"`{key}` must be a non-empty list")
    for t in turns:
        if not isinstance(t, dict) or not isinstance(t.get(who), str) or not isinstance(t.get(what), str):
            raise MalformedRecord(f"{name} needs string `{who}` and `{what}`")
    return [(t[who], t[what]) for t in turns]


def _tokenized_record(rec: dict, vocab_size: int = 0) -> tuple[list[int], list[int]]:
    ids, mask = rec.get("input_ids"), rec.get("loss_mask")
    if not isinstance(ids, list) or not isinstance(mask, list):
        raise MalformedRecord("tokenized records need list `input_ids` and list `loss_mask`")
    if len(ids) != len(mask):
        raise MalformedRecord(f"input_ids has {len(ids)} tokens but loss_mask has {len(mask)}")
    # `type(t) is int`: JSON true is a Python bool, an int subclass, and would train as token 1 (or as
    # mask 1); a float 1.0 passes `in (0, 1)` too
    if not all(type(t) is int and t >= 0 for t in ids) or not all(type(m) is int and m in (0, 1) for m in mask):
        raise MalformedRecord("input_ids must be non-negative ints and loss_mask 0/1")
    if vocab_size and ids and max(ids) >= vocab_size:
        raise OutOfVocab(f"token id {max(ids)} is outside the target's vocabulary of {vocab_size} (ids 0..{vocab_size - 1})")
    return ids, [int(m) for m in mask]


def record_tokens(rec: dict, fmt: str, tokenizer, enable_thinking: bool, vocab_size: int = 0
                  ) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one record; MalformedRecord if it cannot be tokenized. `vocab_size`
    (0 = unchecked) bounds pre-tokenized ids; the tokenizer's own ids are the target's by construction."""
    kind = detect_format(rec, fmt)
    if kind == "tokenized":
        return _tokenized_record(rec, vocab_size)
    messages = to_messages(rec, kind)
    from jinja2.exceptions import TemplateError

    try:
        return tokenize_conversation(tokenizer, messages, enable_thinking=enable_thinking)
    except MalformedRecord:
        raise
    # Templates reject records with raise_exception (TemplateError), e.g. roles out of order.
    except (TemplateError, ValueError, TypeError, KeyError) as e:
        raise MalformedRecord(f"chat template failed: {e}") from e
