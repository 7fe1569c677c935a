"""Sampled softmax for the drafter's loss: the LM head over a slice of the vocabulary while training.

On a CPU (and for a small drafter anywhere) the frozen 49,152 x 576 head of SmolLM2 is ~87% of a training
step's FLOPs: every block row pays a full-vocabulary matmul forward and again for the input gradient. A step
only needs the softmax's normaliser and the labels' logits, so `drafter.loss_negatives: N` trains on the
columns that matter (sampled softmax, Jean et al. 2015):

- every label of the micro-batch and the mask token (the token a fresh drafter predicts everywhere: its
  embedding passes through the residual to the tied head), always in, uncorrected;
- N further ids drawn uniformly without replacement from the rest, each logit raised by log(rest / N), so
  the slice's sum of exp(logits) is an unbiased estimate of the full vocabulary's.

At inference nothing changes (the full head, what the engines serve). Training steps that sample the
expensive metrics (`train.sample_every`) also compute the full-vocabulary loss of the same rows, so the step
log shows the sampled loss against the exact one (`full_loss`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class VocabSlice:
    """The head's columns one micro-batch trains on, the logit correction of each, and the labels' places."""

    cols_C: torch.Tensor  # long, vocabulary ids, the always-in ones first
    bias_C: torch.Tensor  # float32, added to each column's logit (0 for the always-in ids)
    local_labels_R: torch.Tensor  # long, each label's index into cols_C


def sample_columns(labels_R: np.ndarray, always: tuple[int, ...], vocab_size: int, negatives: int,
                   generator: torch.Generator | None) -> tuple[np.ndarray, np.ndarray]:
    """(columns, bias): the labels' distinct ids and `always` uncorrected, then `negatives` uniform others
    (fewer when the vocabulary has fewer left) corrected by log(left / drawn). Host only."""
    must = np.unique(np.concatenate([np.asarray(labels_R, np.int64).reshape(-1), np.asarray(always, np.int64)]))
    must = must[(must >= 0) & (must < vocab_size)]
    left = vocab_size - len(must)
    take = min(negatives, left)
    if take <= 0:
        return must, np.zeros(len(must), np.float32)
    # Draw among the ids not in `must`: a permutation's first `take` positions of the complement's indices.
    keep = np.ones(vocab_size, bool)
    keep[must] = False
    rest = np.flatnonzero(keep)
    pick = rest[torch.randperm(left, generator=generator)[:take].numpy()]
    cols = np.concatenate([must, np.sort(pick)])
    bias = np.concatenate([np.zeros(len(must), np.float32), np.full(take, math.log(left / take), np.float32)])
    return cols, bias


def vocab_slice(labels_R: np.ndarray, always: tuple[int, ...], vocab_size: int, negatives: int,
                generator: torch.Generator | None, device) -> VocabSlice:
    """`sample_columns` on `device`, with every label's index into the columns."""
    cols, bias = sample_columns(labels_R, always, vocab_size, negatives, generator)
    where = np.full(vocab_size, -1, np.int64)
    where[cols] = np.arange(len(cols))
    local = where[np.clip(np.asarray(labels_R, np.int64), 0, vocab_size - 1)]
    assert (local >= 0).all(), "every label is one of the slice's columns"
    return VocabSlice(torch.from_numpy(cols).to(device), torch.from_numpy(bias).to(device),
                      torch.from_numpy(local).to(device))
