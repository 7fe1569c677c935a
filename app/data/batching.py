"""Packing a job's sequences for the target, and its features for the object store.

Hidden states travel as numpy (bf16 as a uint16 view) inside a `HiddenBatch`, so Ray stores the
arrays out of band and a drafter on the same node maps them without a copy.
"""
from __future__ import annotations

import numpy as np
import torch

from app.messages import HiddenBatch


def pad_sequences(seqs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-pad (input_ids, loss_mask) pairs: ids_BS int64, mask_BS uint8 (0 on padding), lengths_B."""
    lengths_B = np.array([len(ids) for ids, _ in seqs], dtype=np.int64)
    S = int(lengths_B.max())
    ids_BS = np.zeros((len(seqs), S), dtype=np.int64)
    mask_BS = np.zeros((len(seqs), S), dtype=np.uint8)
    for row, (ids, mask) in enumerate(seqs):
        ids_BS[row, : len(ids)] = ids
        mask_BS[row, : len(mask)] = mask
    return ids_BS, mask_BS, lengths_B


def pack_hidden(job_id: int, feats_BSD: torch.Tensor, ids_BS: np.ndarray, mask_BS: np.ndarray,
                lengths_B: np.ndarray) -> HiddenBatch:
    """Features to numpy: bf16 as its raw uint16 bits (numpy has no bf16), others as they are."""
    feats = feats_BSD.detach().cpu().contiguous()
    if feats.dtype == torch.bfloat16:
        hidden, dtype = feats.view(torch.int16).numpy().view(np.uint16), "bfloat16"
    elif feats.dtype == torch.float16:
        hidden, dtype = feats.numpy(), "float16"
    else:
        hidden, dtype = feats.float().numpy(), "float32"
    return HiddenBatch(job_id=job_id, hidden_BSD=hidden, hidden_dtype=dtype, input_ids_BS=ids_BS,
                       loss_mask_BS=mask_BS, lengths_B=lengths_B)



def job_hidden_batch(model, seqs: list[tuple[np.ndarray, np.ndarray]], job_id: int, layer_ids: list[int],
                     device: torch.device) -> HiddenBatch:
    """One target job: pad its sequences, run the frozen target once, pack the features."""
    from app.model.features import target_features

    ids_BS, mask_BS, lengths_B = pad_sequences(seqs)
    with torch.inference_mode():
        ids = torch.from_numpy(ids_BS).to(device)
        attn_BS = (torch.arange(ids.shape[1])[None, :] < torch.from_numpy(lengths_B)[:, None]).long().to(device)
        feats_BSD = target_features(model, ids, attn_BS, layer_ids)
    return pack_hidden(job_id, feats_BSD, ids_BS, mask_BS, lengths_B)
