"""`python -m app.instructions --out-dir DIR [--train N] [--eval N] [--seed S]`: write the instruction prompt set.

DIR gets prompts_train.jsonl (the input of `python -m app.regenerate`: the target writes the responses) and
eval_prompts.jsonl (`data.eval_prompts` as is), built from this Python's own standard library
(app/data/instruction_set.py: five kinds of instruction, train and eval from disjoint sources).

Run: python -m app.instructions --out-dir .cache/smol --train 192 --eval 32 --seed 0
"""
from __future__ import annotations

import argparse
import json
import os
import uuid
from pathlib import Path

TRAIN_FILE, EVAL_FILE = "prompts_train.jsonl", "eval_prompts.jsonl"


def write_jsonl(path: Path, items: list) -> bool:
    """Write `Instruction` records atomically (temp file renamed into place): a reader never sees half a file.
    A file that already holds exactly these records is left alone (its mtime too: `make smol` regenerates the
    responses only when the prompts changed). Returns whether it wrote."""
    text = "".join(json.dumps(it.record()) + "\n" for it in items)
    if path.is_file() and path.read_text() == text:
        return False
    tmp = path.parent / f".tmp-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return True


def write_prompt_files(out_dir: str | Path, seed: int = 0, num_train: int = 192, num_eval: int = 32) -> dict:
    """prompts_train.jsonl (to regenerate) and eval_prompts.jsonl in `out_dir`; returns their paths and counts."""
    from app.data.instruction_set import KINDS, build_instructions

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, evals = build_instructions(num_train, num_eval, seed=seed)
    write_jsonl(out / TRAIN_FILE, train)
    write_jsonl(out / EVAL_FILE, evals)
    kinds = {k: sum(it.kind == k for it in train) for k in KINDS}
    return {"train_file": str(out / TRAIN_FILE), "eval_file": str(out / EVAL_FILE), "train": len(train),
            "eval": len(evals), "train_kinds": kinds,
            "settings": {"seed": seed, "num_train": num_train, "num_eval": num_eval}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.instructions", description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True, help="folder for prompts_train.jsonl and eval_prompts.jsonl")
    parser.add_argument("--train", type=int, default=192, help="training prompts (their responses are regenerated)")
    parser.add_argument("--eval", type=int, default=32, help="held-out prompts (data.eval_prompts)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    args = parser.parse_args(argv)
    info = write_prompt_files(args.out_dir, args.seed, args.train, args.eval)
    print(f"{info['train']} train prompts ({', '.join(f'{k} {v}' for k, v in info['train_kinds'].items())}) -> "
          f"{info['train_file']}; {info['eval']} eval prompts -> {info['eval_file']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
