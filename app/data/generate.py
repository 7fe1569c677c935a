# Not model.generate: it fills unset fields from a checkpoint's generation_config.json, and limits tokens per batch.
"""Batched greedy generation with a KV cache, shared by the tiny-target build and `app.regenerate`.

A hand-written loop instead of `model.generate`: it gives per-prompt token limits, explicit stop and
suppressed ids, and no dependence on whatever `generation_config.json` a checkpoint ships with. transformers
(5.25) fills every field a passed `GenerationConfig` leaves unset from the checkpoint's file, so a shipped
`repetition_penalty` changes what `GenerationConfig(do_sample=False)` produces (checked on the tiny Qwen3
target: penalty 1.5 turned twelve greedy 17s into other tokens; this loop's output did not move).
Prompts are grouped by length (sorted) so a batch carries little left padding.
"""
from __future__ import annotations

from collections.abc import Sequence


def greedy_generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    *,
    pad_id: int,
    stop_ids: Sequence[int] = (),
    suppress_ids: Sequence[int] = (),
    batch_size: int = 32,
    device: str = "cpu",
) -> list[list[int]]:
    """Greedy continuations of `prompts`, in input order, without the prompt and without a stop id.

    `max_new_tokens` is one limit or one per prompt. Generation of a row ends at its limit or at
    its first token in `stop_ids`; ids in `suppress_ids` are never produced.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    n = len(prompts)
    limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(limits) != n:
        raise ValueError(f"got {len(limits)} max_new_tokens for {n} prompts; give one per prompt")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    # Sort by (limit, prompt length): a batch stops together (its steps are what costs) and pads little.
    order = sorted(range(n), key=lambda i: (limits[i], len(prompts[i])))
    results: list[list[int]] = [[] for _ in range(n)]
    for start in range(0, n, batch_size):
        rows = order[start : start + batch_size]
        outs = _greedy_batch(
            model,
            [list(prompts[i]) for i in rows],
            [limits[i] for i in rows],
            pad_id=pad_id,
            stop_ids=stop_ids,
            suppress_ids=suppress_ids,
            device=device,
        )
        for i, out in zip(rows, outs):
            results[i] = out
    return results


def _greedy_batch(model, batch, limits, *, pad_id, stop_ids, suppress_ids, device) -> list[list[int]]:
    """One left-padded batch through prefill and a token-by-token decode over the KV cache."""
    import torch

    rows, width = len(batch), max(len(p) for p in batch)
    ids_BS = torch.full((rows, width), pad_id, dtype=torch.long)
    attn_BS = torch.zeros((rows, width), dtype=torch.long)
    for r, p in enumerate(batch):
        ids_BS[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attn_BS[r, width - len(p) :] = 1
    ids_BS, attn_BS = ids_BS.to(device), attn_BS.to(device)
    # Left padding: real tokens get positions 0..len-1 whatever their column.
    pos_BS = (attn_BS.cumsum(-1) - 1).clamp(min=0)
    limit_B = torch.tensor(limits, dtype=torch.long, device=device)
    stop_t = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    suppress = list(suppress_ids)

    cache_kw = _cache_kwarg(model)
    generated: list = []
    done_B = limit_B <= 0
    with torch.no_grad():
        out = model(
            input_ids=ids_BS, attention_mask=attn_BS, position_ids=pos_BS, use_cache=True, logits_to_keep=1
        )
        next_pos_B = pos_BS[:, -1] + 1
        for step in range(int(limit_B.max().item())):
            logits_BV = out.logits[:, -1, :].float()
            if suppress:
                logits_BV[:, suppress] = float("-inf")
            tok_B = logits_BV.argmax(-1)
            tok_B = torch.where(done_B, torch.full_like(tok_B, -1), tok_B)
            generated.append(tok_B)
            if len(stop_t):
                done_B = done_B | torch.isin(tok_B, stop_t)
            done_B = done_B | (limit_B <= step + 1)
            if bool(done_B.all()):
                break
            attn_BS = torch.cat([attn_BS, torch.ones((rows, 1), dtype=attn_BS.dtype, device=device)], dim=1)
            feed_B = torch.where(tok_B < 0, torch.full_like(tok_B, pad_id), tok_B)
            out = model(
                input_ids=feed_B[:, None],
                attention_mask=attn_BS,
                position_ids=next_pos_B[:, None],
                use_cache=True,
                **{cache_kw: _cache_of(out)},
            )
            next_pos_B = next_pos_B + 1
    return _trim(generated, rows, set(int(s) for s in stop_ids))


def _cache_kwarg(model) -> str:
    """transformers 5.x renamed `past_key_values` to `cache` (the old name warns); accept both."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _trim(generated, rows: int, stops: set[int]) -> list[list[int]]:
    """Per row: the tokens up to (not including) the first stop id or the first finished marker."""
    import torch

    if not generated:
        return [[] for _ in range(rows)]
    gen_BT = torch.stack(generated, dim=1).tolist()
    outs = []
    for row in gen_BT:
        kept = []
        for t in row:
            if t < 0 or t in stops:
                break
            kept.append(t)
        outs.append(kept)
    return outs
