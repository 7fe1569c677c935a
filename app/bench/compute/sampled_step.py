"""`python -m app.bench sampled_step [--negatives 4096] [--repeats 6] [--threads 1]`: one drafter training step
(forward + backward + AdamW) at SmolLM2-135M's shapes with the full LM head against a sampled-softmax slice
(`drafter.loss_negatives`), interleaved in one process on the same job, and the share of the step the head takes.

The target's shapes (hidden 576, 49,152 tied rows, 30 layers) come from a Llama config built in memory (no
weights needed: the head is random, as the step's cost does not depend on its values); the job is conf/smol.yaml's:
one drafter layer, block 16, 16 anchors per sequence, 512 padded tokens (two 256-token sequences, 75% answer).
Ends with `RESULT bench=sampled_step full_ms=... sampled_ms=... speedup=... labels_only_ms=... head_share=...`
(labels_only_ms: the same step with a slice of the labels and one negative, about what the layer and the rest
cost; head_share = 1 - labels_only / full).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from app.bench.common import print_result


def _parts(vocab: int, negatives: int):
    from transformers import LlamaConfig

    from app.config.drafter_sections import DrafterConfig, TrainConfig
    from app.model.arch import DrafterArch
    from app.model.drafter import DFlashDrafter
    from app.model.loss import TrainBatch
    from app.model.target_head import TargetHead
    from app.training.trainer import DrafterTrainer

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=vocab, tie_word_embeddings=True)
    dcfg = DrafterConfig(num_layers=1, block_size=16, num_anchors=16, mask_token_id=16, max_rows=0,
                         loss_negatives=negatives)
    arch = DrafterArch.from_target(cfg, dcfg, [1, 7, 14, 21, 27])
    torch.manual_seed(0)
    drafter = DFlashDrafter(arch)
    emb = torch.randn(vocab, 576) * 0.05
    head = TargetHead(emb, emb)
    trainer = DrafterTrainer(drafter, head, dcfg, TrainConfig(sample_every=0), 1000, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 256), generator=g)
    mask = torch.zeros(2, 256)
    mask[:, 64:] = 1
    batch = TrainBatch(ids, mask, torch.randn(2, 256, arch.feature_dim, generator=g), torch.tensor([256, 256]))
    return trainer, batch


def _step_ms(trainer, batch, job: int) -> float:
    t0 = time.perf_counter()
    trainer.micro_step(batch, job)
    trainer.finish_step()
    return 1000 * (time.perf_counter() - t0)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.bench sampled_step", description=__doc__.splitlines()[0])
    ap.add_argument("--negatives", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sides = {"full": _parts(49152, 0), "sampled": _parts(49152, args.negatives), "labels_only": _parts(49152, 1)}
    times: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(args.repeats + 1):  # the first round warms up, untimed; then the sides alternate
        for name in (list(sides) if r % 2 else list(sides)[::-1]):
            ms = _step_ms(*sides[name], job=r)
            if r:
                times[name].append(ms)
    med = {k: statistics.median(v) for k, v in times.items()}
    print_result([("bench", "sampled_step"), ("negatives", args.negatives), ("threads", args.threads),
                  ("full_ms", med["full"]), ("sampled_ms", med["sampled"]), ("speedup", med["full"] / med["sampled"]),
                  ("labels_only_ms", med["labels_only"]), ("head_share", 1 - med["labels_only"] / med["full"])])
    return 0
