"""The real target's side of `python -m app.bench quality --target smol`: prompts, greedy references, features.

On CPU the target's forwards are the slow part (SmolLM2-135M: ~110 greedy tokens/s at batch 32, a 512-token
forward with hidden states 1.65 s on 2 threads), so both are computed once and kept on disk under
`.cache/bench-quality/`, each file keyed by the sha256 of everything that determines it:

- greedy references (`greedy_outputs`): the target's folder (its name carries the GGUF's sha256), one batch's
  prompt ids (its left padding changes rounding), the token budget and the stop and pad ids. Each is
  the target's greedy continuation up to `max_new_tokens`, its EOS included when it stopped there: what
  `greedy_reference` returns and what speculative decoding must reproduce.
- features (`sequence_features`): the target folder, the layer ids and every sequence's ids. Computed by the
  code the TargetActor runs (`app.data.target_forward.job_hidden_batch` through a `TargetTrunk`), kept as bfloat16
  (as a GPU run's features travel; a CPU run ships the fp32 ones, equal up to that rounding) in one flat
  [tokens, k*H] tensor with per-sequence offsets.

The target comes through the project's GGUF loader (`app.model.gguf_target`), the prompts from the
instruction builder (`app.data.instruction_set`), chat-templated as the data path renders a user turn.
The training records are the prompts with their greedy responses as pre-tokenized JSONL (`input_ids`,
`loss_mask` on the response), so the run's own tokenized-data path, bucketing and job schedule read them.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from app.bench.common import ROOT

CACHE = ROOT / ".cache" / "bench-quality"
CACHE_VERSION = 1  # bump when what a cached file holds changes


def cache_key(*parts) -> str:
    """sha256 (first 24 hex digits) of the parts as JSON, with the cache version."""
    return hashlib.sha256(json.dumps([CACHE_VERSION, *parts], default=str).encode()).hexdigest()[:24]


def load_target():
    """(model, tokenizer, folder) of the embedded SmolLM2 through the project's GGUF loader."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.config.gguf_names import EMBEDDED_NAME
    from app.model.gguf_target import converted_dir

    folder = converted_dir(EMBEDDED_NAME, ROOT / ".cache" / "gguf")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder), folder


def prompt_ids(tokenizer, num_train: int, num_eval: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Chat-templated ids of `num_train` training and `num_eval` held-out instructions (disjoint)."""
    from app.data.chat_mask import render
    from app.data.instruction_set import build_instructions

    train, held_out = build_instructions(num_train, num_eval, seed=seed)

    def ids(text: str) -> list[int]:
        rendered = render(tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True, enable_thinking=False)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]

    return [ids(t.text) for t in train], [ids(t.text) for t in held_out]


def greedy_outputs(model, model_id: str, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int,
                   pad_id: int, batch_size: int = 32, cache: Path = CACHE, log=print) -> list[list[int]]:
    """Greedy continuations of `prompts` (EOS included where it stopped), in batches of similar prompt
    lengths, each batch cached on disk as it completes (an interrupted bench keeps what it generated)."""
    from app.data.generate import greedy_generate

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outs: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        batch = [prompts[i] for i in rows]
        path = cache / f"greedy-{cache_key(model_id, batch, max_new_tokens, eos_token_id, pad_id)}.json"
        if path.is_file():
            got = json.loads(path.read_text())
        else:
            log(f"quality: greedy references {start + 1}-{start + len(rows)} of {len(prompts)} "
                f"(up to {max_new_tokens} tokens, batch {len(rows)})")
            with torch.no_grad():
                got = greedy_generate(model, batch, max_new_tokens, pad_id=pad_id, stop_ids=[eos_token_id],
                                      batch_size=len(rows))
            got = [o + [eos_token_id] if len(o) < max_new_tokens else o for o in got]  # stopped early: at EOS
            _write(path, json.dumps(got))
        for i, out in zip(rows, got):
            outs[i] = out
    return outs


@dataclass
class Features:
    """Features of many sequences: `flat[offsets[i]:offsets[i + 1]]` is sequence i's [length, k*H]."""

    flat: torch.Tensor  # bfloat16
    offsets: list[int]

    def of(self, i: int) -> torch.Tensor:
        return self.flat[self.offsets[i]:self.offsets[i + 1]]


def sequence_features(model, model_id: str, seqs: list[list[int]], layer_ids: list[int], tokens_per_batch: int = 2048,
                      cache: Path = CACHE, log=print) -> Features:
    """The target's features of every sequence (`job_hidden_batch`, padded batches of similar lengths), cached."""
    from app.data.target_forward import job_hidden_batch
    from app.model.target_trunk import TargetTrunk

    path = cache / f"features-{cache_key(model_id, list(layer_ids), seqs)}.pt"
    if path.is_file():
        saved = torch.load(path)
        return Features(saved["flat"], saved["offsets"])
    log(f"quality: target features of {len(seqs)} sequences ({sum(map(len, seqs))} tokens, layers {list(layer_ids)})")
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).tolist()
    trunk = TargetTrunk(model, layer_ids)
    flat = None
    try:
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        start = 0
        while start < len(order):
            rows = [order[start]]
            while start + len(rows) < len(order) and len(seqs[order[start + len(rows)]]) * (len(rows) + 1) <= tokens_per_batch:
                rows.append(order[start + len(rows)])
            start += len(rows)
            job = [(np.asarray(seqs[i], dtype=np.int64), np.ones(len(seqs[i]), dtype=np.uint8)) for i in rows]
            hb = job_hidden_batch(trunk, job, 0, list(layer_ids), torch.device("cpu"), packed=False,
                                  feature_dtype="float32")
            hidden = torch.from_numpy(np.asarray(hb.hidden_BSD))
            if flat is None:
                flat = torch.empty(offsets[-1], hidden.shape[-1], dtype=torch.bfloat16)
            for row, i in enumerate(rows):
                flat[offsets[i]:offsets[i + 1]] = hidden[row, :len(seqs[i])].to(torch.bfloat16)
    finally:
        trunk.remove()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"flat": flat, "offsets": offsets}, tmp)
    tmp.rename(path)
    return Features(flat, offsets)


def write_training_records(path: Path, prompts: list[list[int]], responses: list[list[int]]) -> Path:
    """Pre-tokenized JSONL: prompt + greedy response, the loss on the response tokens."""
    lines = [json.dumps({"input_ids": p + r, "loss_mask": [0] * len(p) + [1] * len(r)}) for p, r in zip(prompts, responses)]
    _write(path, "\n".join(lines) + "\n")
    return path


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.rename(path)
