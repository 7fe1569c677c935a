"""Chat template rendering and the assistant-only loss mask.

Two ways to find the assistant tokens:
- Templates with `{% generation %}` markers: HF's `return_assistant_tokens_mask`.
- Any other template (Qwen, Llama, ... ship none): render the conversation up to each assistant turn
  with the generation prompt (where the turn's text starts) and through the turn (where it ends),
  take those character spans of the full rendering, and mask the tokens whose character offsets
  overlap a span. Working in characters, not token counts, keeps BPE merges across a boundary
  harmless. If a template renders history differently from a prefix (e.g. strips reasoning), the
  turn's content is located in the full text instead, plus the end-of-turn token that follows it.
Trailing whitespace after the end-of-turn token (ChatML's "\\n") is not part of the span.

A special token's text inside a turn (`<|im_start|>` written out in a user's message) would be read as
the control token itself once the rendering is tokenized: a crafted record could open a forged
assistant turn and move the loss mask onto text the model must never learn to produce. Such a
record is refused (`MalformedRecord`, one line naming the turn and the token), before rendering.
"""
from __future__ import annotations

import re
import weakref

import numpy as np

from app.data.records import MalformedRecord

_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
_SPECIALS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> its specials' pattern


def _malformed(msg: str) -> Exception:
    return MalformedRecord(msg)


def render(tokenizer, messages: list[dict], *, add_generation_prompt: bool, enable_thinking: bool) -> str:
    """The chat template applied to `messages`, as text (templates ignore unknown kwargs)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; use a chat model's tokenizer or tokenized data")
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking
    )


def has_generation_markers(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and bool(_GENERATION_MARKER.search(template))


def special_pattern(tokenizer) -> re.Pattern | None:
    """A pattern matching the text of any of the tokenizer's special tokens (the named ones and every
    added token marked special), longest first; None when it has none. Built once per tokenizer."""
    try:
        return _SPECIALS[tokenizer]
    except (KeyError, TypeError):
        pass
    texts = set(getattr(tokenizer, "all_special_tokens", None) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts |= {str(t) for t in decoder.values() if getattr(t, "special", False)}
    texts = sorted((t for t in texts if t), key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
    try:
        _SPECIALS[tokenizer] = pattern
    except TypeError:  # not weak-referenceable: built again next time
        pass
    return pattern


def refuse_special_text(tokenizer, messages: list[dict]) -> None:
    """`MalformedRecord` when a turn's text holds a special token's text (it would tokenize as the
    control token and could forge a turn; see the module docstring)."""
    pattern = special_pattern(tokenizer)
    if pattern is None:
        return
    for i, msg in enumerate(messages):
        if (m := pattern.search(msg["content"])) is not None:
            raise _malformed(f"turn {i + 1} ({msg['role']}) holds the special token {m.group()!r} as text, which "
                             "would be read as a control token (a forged turn); remove it from the record")


def tokenize_conversation(tokenizer, messages: list[dict], *, enable_thinking: bool = False) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a conversation: mask 1 on every assistant turn's tokens. A turn holding
    a special token's text is refused (`refuse_special_text`)."""
    refuse_special_text(tokenizer, messages)
    if has_generation_markers(tokenizer):
        out = _marker_mask(tokenizer, messages, enable_thinking)
        if out is not None:
            return out
    full = render(tokenizer, messages, add_generation_prompt=False, enable_thinking=enable_thinking)
    spans = assistant_char_spans(tokenizer, messages, full, enable_thinking)
    return _mask_from_spans(tokenizer, full, spans)


def _marker_mask(tokenizer, messages, enable_thinking) -> tuple[list[int], list[int]] | None:
    enc = tokenizer.apply_chat_template(
        messages,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        enable_thinking=enable_thinking,
    )
    ids, mask = list(enc["input_ids"]), [int(m) for m in enc["assistant_masks"]]
    if any(m["role"] == "assistant" for m in messages) and not any(mask):
        return None  # markers present but not around these turns: use prefix rendering
    return ids, mask


def assistant_char_spans(tokenizer, messages: list[dict], full: str, enable_thinking: bool) -> list[tuple[int, int]]:
    """[start, end) character spans of the assistant turns in the full rendering `full`."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            # Walk past this turn's text, so a later content search cannot land inside it.
            pos = full.find(msg["content"], cursor) if msg["content"] else -1
            cursor = pos + len(msg["content"]) if pos >= 0 else cursor
            continue
        span = _prefix_span(tokenizer, messages, i, full, enable_thinking)
        if span is None or span[0] < cursor:
            span = _search_span(tokenizer, msg["content"], full, cursor)
        start, end = span
        while end > start and full[end - 1].isspace():
            end -= 1
        spans.append((start, end))
        cursor = end
    return spans


def _prefix_span(tokenizer, messages, i, full, enable_thinking) -> tuple[int, int] | None:
    if i == 0:
        return None  # no prefix to render; the content search handles it
    before = render(tokenizer, messages[:i], add_generation_prompt=True, enable_thinking=enable_thinking)
    through = render(tokenizer, messages[: i + 1], add_generation_prompt=False, enable_thinking=enable_thinking)
    if len(before) < len(through) and full.startswith(before) and full.startswith(through):
        return len(before), len(through)
    return None


def _search_span(tokenizer, content: str, full: str, cursor: int) -> tuple[int, int]:
    if not content:
        return cursor, cursor  # an empty turn has no tokens to learn
    start = full.find(content, cursor)
    if start < 0:
        raise _malformed("cannot locate an assistant turn in the rendered chat template")
    end = start + len(content)
    eot = getattr(tokenizer, "eos_token", None)
    # The end-of-turn token belongs to the turn: the model must learn to stop.
    if eot and full.startswith(eot, end):
        end += len(eot)
    return start, end


def _mask_from_spans(tokenizer, full: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    if not getattr(tokenizer, "is_fast", False):
        return _mask_from_spans_slow(tokenizer, full, spans)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    off = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(ids), dtype=bool)
    for start, end in spans:
        mask |= (off[:, 0] < end) & (off[:, 1] > start)
    return ids, mask.astype(np.int64).tolist()


def _mask_from_spans_slow(tokenizer, full: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Slow tokenizers have no offsets: count tokens of text prefixes instead."""
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    mask = [0] * len(ids)
    for start, end in spans:
        lo = len(tokenizer(full[:start], add_special_tokens=False)["input_ids"])
        hi = len(tokenizer(full[:end], add_special_tokens=False)["input_ids"])
        for j in range(lo, min(hi, len(ids))):
            mask[j] = 1
    return ids, mask
