"""Realistic drafter micro-batches at the shapes of a config (shared by the memory and FLOP benches).

Length mix (stated, not measured from a dataset): in bucket b, sequence lengths are uniform over
(boundary[b-1], boundary[b]] (the first bucket starts at 64); each sequence's first 30% is prompt
(loss mask 0) and the rest is the assistant turn (loss mask 1). Sequences are sorted and packed
into jobs under `data.tokens_per_job` padded tokens exactly as the schedule does (`pack_jobs`), and
anchors are drawn as the loss draws them: up to `drafter.num_anchors` positions p with
loss_mask[p] = 1 and p <= len - B, without replacement.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PROMPT_SHARE = 0.3
FIRST_BUCKET_START = 64


@dataclass(frozen=True)
class BenchJob:
    """One drafter micro-batch: its sequences' lengths and every block's (sequence, anchor)."""

    bucket: int
    block_size: int
    lengths: np.ndarray  # [N]
    seq_M: np.ndarray  # [M] sequence of each block, grouped, anchors sorted
    anchors_M: np.ndarray  # [M]

    @property
    def rows(self) -> int:
        """Query rows: real blocks x block size (no padded anchors)."""
        return int(len(self.seq_M)) * self.block_size

    def max_anchors(self) -> int:
        """The old padded layout's A: the most anchors of any sequence in the job."""
        return int(np.bincount(self.seq_M, minlength=len(self.lengths)).max()) if len(self.seq_M) else 0


def bucket_job(cfg, bucket: int, seed: int = 0, pick: str = "rows") -> BenchJob:
    """One job of a bucket under the stated length mix: of 8 jobs spread over the bucket's sorted
    lengths, the one with the most query rows (`pick="rows"`: the memory worst case) or with the
    longest sequence (`pick="longest"`: the bucket's own shape, e.g. S near 3,072 in the last)."""
    from app.data.schedule import pack_jobs

    bounds = list(cfg.data.bucket_boundaries)
    lo = bounds[bucket - 1] if bucket else FIRST_BUCKET_START
    hi = bounds[bucket]
    rng = np.random.default_rng([seed, bucket])
    per_job = max(1, cfg.data.tokens_per_job // hi)
    lengths = np.sort(rng.integers(lo + 1, hi + 1, size=per_job * 10))
    all_jobs = pack_jobs(np.arange(len(lengths)), lengths, cfg.data.tokens_per_job)
    full = all_jobs[:-1] or all_jobs  # the last job holds the remainder: not a typical job
    jobs = [full[i] for i in np.unique(np.linspace(0, len(full) - 1, 8).astype(int))]
    B, A = cfg.drafter.block_size, cfg.drafter.num_anchors
    best = None
    for ids in jobs:
        job_len = lengths[ids]
        seq, anchors = [], []
        for n, L in enumerate(job_len.tolist()):
            first, last = int(np.ceil(PROMPT_SHARE * L)), L - B
            cand = np.arange(first, last + 1)
            if len(cand) > A:
                cand = np.sort(rng.choice(cand, size=A, replace=False))
            seq.append(np.full(len(cand), n))
            anchors.append(cand)
        job = BenchJob(bucket, B, job_len, np.concatenate(seq).astype(np.int64), np.concatenate(anchors).astype(np.int64))
        key = job.rows if pick == "rows" else int(job_len.max())
        if best is None or key > best_key:
            best, best_key = job, key
    return best


def default_arch(cfg, width_div: int = 1):
    """A Qwen3-8B-shaped drafter arch (hidden 4096, 32/8 heads of 128, MLP 12288, vocab 151,936,
    36 target layers) with the config's drafter settings; `width_div` narrows hidden, MLP and heads."""
    from app.model.arch import DrafterArch
    from app.config.drafter_sections import default_target_layer_ids

    f = width_div
    return DrafterArch(
        hidden_size=4096 // f, num_layers=cfg.drafter.num_layers, num_heads=max(1, 32 // f),
        num_kv_heads=max(1, 8 // f), head_dim=128, intermediate_size=12288 // f, rms_norm_eps=1e-6,
        rope_theta=1e6, vocab_size=151936, block_size=cfg.drafter.block_size,
        target_layer_ids=tuple(default_target_layer_ids(36, cfg.drafter.num_layers)), mask_token_id=151669,
        max_position_embeddings=40960, num_target_layers=36)
