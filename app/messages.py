"""Typed messages that cross actor boundaries.

Everything here is a plain dataclass of numbers, strings and numpy arrays, so Ray pickles it with
numpy buffers out of band: a `HiddenBatch` read from the object store is a zero-copy view. Treat
what you read as read-only; other readers share the buffer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Job ids are unique across epochs: the epoch sits in the high bits, the schedule index below.
_EPOCH_SHIFT = 32


def make_job_id(epoch: int, index: int) -> int:
    """The ledger key of job `index` of `epoch`."""
    assert 0 <= index < (1 << _EPOCH_SHIFT) and epoch >= 0
    return (epoch << _EPOCH_SHIFT) | index


def split_job_id(job_id: int) -> tuple[int, int]:
    """Inverse of make_job_id: (epoch, index)."""
    return job_id >> _EPOCH_SHIFT, job_id & ((1 << _EPOCH_SHIFT) - 1)


@dataclass(frozen=True)
class JobSpec:
    """One target micro-batch: sequences of one bucket, a pure function of (seed, epoch, index)."""

    job_id: int
    epoch: int
    index: int
    bucket: int
    seq_indices: tuple[int, ...]  # rows of the tokenized dataset
    padded_tokens: int  # longest sequence x number of sequences
    est_bytes: int = 0  # expected payload size, for the pool's byte budget before it exists
    cost: int = 0  # drafter query rows: sum over sequences of min(num_anchors, valid anchors) x block_size; 0 = unknown


@dataclass(frozen=True)
class ItemMeta:
    """What a target reports about one finished job; small, fetched by the pool."""

    job_id: int
    bucket: int
    num_seqs: int
    num_tokens: int  # real (unpadded) tokens
    loss_tokens: int
    nbytes: int  # payload size in the object store
    target_id: int
    forward_s: float


@dataclass
class HiddenBatch:
    """The payload of one job: target features for each sequence, padded to the job's longest.

    `hidden_BSD` holds the concatenation of `hidden_states[l + 1]` for `l` in target_layer_ids
    (D = len(layers) * hidden); bf16 travels as a uint16 view (`hidden_dtype == "bfloat16"`), FP8 as
    uint8 codes with a float32 scale per token (`hidden_dtype == "float8_e4m3"`, app/model/feature_codec.py).
    """

    job_id: int
    hidden_BSD: np.ndarray
    hidden_dtype: str
    input_ids_BS: np.ndarray  # int64
    loss_mask_BS: np.ndarray  # uint8, 0 on padding
    lengths_B: np.ndarray  # int64
    hidden_scale_BS: np.ndarray | None = None  # float32 per-token scales of FP8 features, else None


@dataclass(frozen=True)
class PulledItem:
    """A leased item handed to a drafter: its meta and the pool-owned payload ref."""

    meta: ItemMeta
    payload_ref: Any  # ray.ObjectRef[HiddenBatch]; the pool is the owner


@dataclass(frozen=True)
class EndOfStream:
    """Every scheduled job is acked; the drafter should finish."""

    reason: str = "all jobs acked"


@dataclass(frozen=True)
class Drained:
    """Nothing to hand out now: every job is produced and none is buffered, but leases are
    still unacked (or, once production is over, the pull policy ends this step early so the last
    items split into equal steps). The drafter should finish its step with what it holds (zero
    gradients if nothing), ack, and pull again; end-of-stream follows once every lease is acked."""

    reason: str = "all produced, nothing buffered, leases outstanding"


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step as seen by one drafter rank; sent to the pool (the telemetry hub)."""

    rank: int
    step: int
    epoch: int
    loss: float  # the step's global loss (all ranks' weighted CE / global weight sum; same on every rank)
    weight_sum: float  # the step's global loss-weight sum
    correct: float  # the step's global top-1 accuracy over predicted positions
    tokens: int  # real tokens trained on this rank during the step
    accept_len: float  # mean expected acceptance length per block on this rank
    per_pos_acc: list[float] = field(default_factory=list)  # block positions 1..B-1
    topk_acc: float = -1.0  # top-5 accuracy over the vocabulary on sampling steps, else -1
    # The full vocabulary's loss of the step's rows: the loss itself without drafter.loss_negatives, measured on
    # sampling steps with it (the exact figure the sampled loss is checked against); -1 when not measured.
    full_loss: float = -1.0
    compute_s: float = 0.0
    data_wait_s: float = 0.0
    lr: float = 0.0
    grad_norm: float = 0.0
    job_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class TargetFailure:
    """A target call that failed: the job went back to the queue; the driver decides on a restart."""

    target_id: int
    job_id: int
    error: str  # exception type and first line

    def __str__(self) -> str:
        return f"target {self.target_id} job {self.job_id}: {self.error}"


class DrafterPhase:
    """Where a drafter rank is inside its loop; the supervision watchdog reads it (app/run/supervise/policy.py)."""

    SETUP = "setup"
    WAIT_DATA = "wait_data"      # blocked in a pull: legitimately idle when nothing is servable
    COMPUTE = "compute"          # forward/backward or a checkpoint, outside any collective
    COLLECTIVE = "collective"    # in the step's all-reduce / all-gather, waiting for the other ranks
    DONE = "done"
    UNRESPONSIVE = "unresponsive"  # set by the supervisor: the rank did not answer a progress query


@dataclass(frozen=True)
class DrafterProgress:
    """A drafter rank's answer to the supervisor's progress query: `phase` for `age_s` seconds, at `step`."""

    rank: int
    phase: str
    age_s: float
    step: int
