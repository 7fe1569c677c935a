"""A job's features through the store: its `HiddenBatch` assembled from its sequences' entries, or a
forwarded job's batch written out sequence by sequence.

A job is served from the store only when every one of its sequences is there and checks out; one
miss and the whole job goes to the target (it needs a forward anyway), whose batch then fills the gaps.
The assembled batch has the forward's layout: right-padded [B, S, D], zeros past each length.
"""
from __future__ import annotations

import numpy as np

from app.data.target_forward import pad_sequences
from app.messages import HiddenBatch
from app.replay.store import ReplayStore, Stored


def replay_job(store: ReplayStore, job_id: int, seqs: list[tuple[np.ndarray, np.ndarray]]) -> HiddenBatch | None:
    """The job's batch from the store, or None when any sequence is missing or bad."""
    found: list[Stored] = []
    for ids, _ in seqs:
        got = store.get(ids)
        if got is None:
            return None
        found.append(got)
    widths = {f.rows.shape[1] for f in found}
    if len(widths) != 1:  # entries of one key always share a width; anything else is not this target's
        return None
    ids_BS, mask_BS, lengths_B = pad_sequences(seqs)
    B, S = ids_BS.shape
    hidden = np.zeros((B, S, widths.pop()), dtype=found[0].rows.dtype)
    scaled = found[0].scales is not None
    scales = np.ones((B, S), dtype=np.float32) if scaled else None  # padding: any scale decodes zeros to zeros
    for row, f in enumerate(found):
        hidden[row, :len(f.rows)] = f.rows
        if scaled:
            scales[row, :len(f.rows)] = f.scales
    return HiddenBatch(job_id=job_id, hidden_BSD=hidden, hidden_dtype=store.key.payload_dtype, input_ids_BS=ids_BS,
                       loss_mask_BS=mask_BS, lengths_B=lengths_B, hidden_scale_BS=scales)


def keep_job(store: ReplayStore, batch: HiddenBatch) -> int:
    """Write each sequence of a forwarded batch (its real positions); returns how many entries were written."""
    if batch.hidden_dtype != store.key.payload_dtype:  # a target whose dtype is not its key's: keep nothing
        return 0
    written = 0
    for row, n in enumerate(batch.lengths_B.tolist()):
        scales = None if batch.hidden_scale_BS is None else batch.hidden_scale_BS[row, :n]
        written += store.put(batch.input_ids_BS[row, :n], batch.hidden_BSD[row, :n], scales, batch.job_id)
    return written
