"""`python -m app.regenerate --config FILE --in IN --out OUT`: responses rewritten by the target.

DFlash drafters learn best from the target's own outputs. This reads a chat dataset (JSONL/Parquet,
OpenAI or ShareGPT), and for every record regenerates each assistant turn greedily with the target,
turn by turn (later turns see the regenerated earlier ones); a conversation that ends with a user
turn gets one generated assistant turn appended. Work is spread over `topology.num_targets`
generator actors (actors/generator.py), in chunks of records with similar lengths.

OUT is JSONL, one `{"id": <line of the record in IN>, "messages": [...]}` per record, in completion
order. Resumable: ids already in OUT are skipped, and a torn last line (a crash mid-write) is cut off.
Each turn is capped so prompt + response stays within `data.max_length`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from app.config import Config


def regenerate_conversations(model, tokenizer, convs: list[list[dict]], *, max_new_tokens: int, max_length: int,
                             batch_size: int = 16, device: str = "cpu", enable_thinking: bool = False) -> list[list[dict]]:
    """Each conversation with every assistant turn regenerated greedily (and one appended if it ends on
    a user turn). Turns whose prompt already fills `max_length` end the conversation there."""
    from app.chat_mask import render
    from app.generate import greedy_generate

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
    from app.data import MalformedRecord, detect_format, iter_records, to_messages

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
                raise ValueError(f"{in_path}:{line_no}: malformed record: {e}. Fix it or set data.on_error=skip") from None
            counts["malformed"] += 1
    counts["pending"] = len(todo)
    return todo, counts


def chunk_by_length(todo: list[tuple[int, list[dict]]], chunk_size: int) -> list[list[tuple[int, list[dict]]]]:
    """Chunks of records of similar text length, so each generator batch pads little."""
    ordered = sorted(todo, key=lambda r: (sum(len(m["content"]) for m in r[1]), r[0]))
    return [ordered[i : i + chunk_size] for i in range(0, len(ordered), chunk_size)]


# ----------------------------------------------------------------------------------- driver


def run_regenerate(cfg: Config, in_path: str, out_path: str, *, max_new_tokens: int, chunk_size: int = 32,
                   batch_size: int = 16) -> dict:
    """Regenerate IN into OUT with `topology.num_targets` generator actors; returns the counts."""
    import ray

    from actors.generator import Generator
    from app.tiny import resolve_target
    from app.topology import uses_gpu

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    todo, counts = pending_records(in_path, cfg.data.format, cfg.data.on_error, read_done_ids(out))
    counts["written"] = 0
    if not todo:
        return counts
    if not ray.is_initialized():
        ray.init(configure_logging=False)
    topo = cfg.topology
    use_gpu = uses_gpu(topo, ray.cluster_resources().get("GPU", 0))
    model_dir = resolve_target(cfg).model_dir
    actor_cls = ray.remote(Generator).options(num_cpus=topo.cpus_per_target,
                                               num_gpus=topo.gpus_per_target if use_gpu else 0)
    actors = [actor_cls.remote(model_dir, cfg.model.dtype, topo.device if use_gpu else "cpu", topo.cpus_per_target)
              for _ in range(topo.num_targets)]
    chunks = chunk_by_length(todo, chunk_size)
    gen_args = dict(max_new_tokens=max_new_tokens, max_length=cfg.data.max_length, batch_size=batch_size,
                    enable_thinking=cfg.data.enable_thinking)
    in_flight: dict = {}
    try:
        with open(out, "a") as f:
            while chunks or in_flight:
                # Two chunks per actor: one generating, one queued behind it.
                for a in actors:
                    while chunks and sum(1 for v in in_flight.values() if v is a) < 2:
                        in_flight[a.regenerate.remote(chunks.pop(0), **gen_args)] = a
                ready, _ = ray.wait(list(in_flight), num_returns=1)
                for ref in ready:
                    del in_flight[ref]
                    for rec_id, messages in ray.get(ref):
                        f.write(json.dumps({"id": rec_id, "messages": messages}) + "\n")
                        counts["written"] += 1
                    f.flush()
                    os.fsync(f.fileno())
    finally:
        for a in actors:
            ray.kill(a)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.regenerate", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML file, e.g. conf/default.yaml")
    parser.add_argument("--in", dest="in_path", required=True, help="chat dataset (JSONL/Parquet, openai or sharegpt)")
    parser.add_argument("--out", required=True, help="JSONL to write (appended to; records already there are skipped)")
    parser.add_argument("--max-new-tokens", type=int, default=0, help="per turn; 0 = up to data.max_length")
    parser.add_argument("--chunk-size", type=int, default=32, help="records per actor task")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences generated together")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)

    from app.config_load import load_config

    cfg = load_config(args.config, args.overrides)
    t0 = time.perf_counter()
    counts = run_regenerate(cfg, args.in_path, args.out, max_new_tokens=args.max_new_tokens or cfg.data.max_length,
                            chunk_size=args.chunk_size, batch_size=args.batch_size)
    print(" ".join(f"{k}={v}" for k, v in counts.items()) + f" -> {args.out} ({time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
