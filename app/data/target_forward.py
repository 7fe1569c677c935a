"""A job's sequences through the target, and its features into a `HiddenBatch` for the object store.

Two ways to feed the target, same features on the real positions:
- padded (the CPU path, and CUDA without flash-attention): right-padded [B, S] with an attention mask;
- packed (CUDA with flash-attention): one row of all the job's tokens with positions restarting per
  sequence, so no FLOP is spent on padding (HF runs varlen flash-attention from the cu_seq_lens).
The packed features are scattered back to the padded [B, S, D] layout drafters read (zeros past each
length, which no drafter reads: context beyond `lengths_B` is masked).

Host copy: on CUDA the features go to pinned host memory on a side stream (`start_job` returns at
once, `PendingBatch.result()` waits), so a target with two jobs in flight overlaps one job's copy with
the next job's forward. On CPU the features already live on the host.

Hidden states travel as numpy (bf16 as a uint16 view) inside a `HiddenBatch`, so Ray stores the
arrays out of band and a drafter on the same node maps them without a copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from app.messages import HiddenBatch
from app.model.feature_codec import FP8_NAME, encode_fp8

FLASH_IMPLS = ("flash_attention_2", "flash_attention_3")


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


def use_packing(model, device: torch.device) -> bool:
    """Packed only where it saves work: flash-attention on CUDA runs varlen. With sdpa a packed row needs a
    [T, T] block-diagonal mask that no fused kernel skips, so padded SDPA is cheaper there (and on CPU)."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return device.type == "cuda" and impl in FLASH_IMPLS


def packed_inputs(ids_BS: np.ndarray, lengths_B: np.ndarray, device: torch.device) -> dict:
    """One row of every sequence's tokens, positions restarting at 0, and varlen flash kwargs."""
    valid_BS = np.arange(ids_BS.shape[1])[None, :] < lengths_B[:, None]
    ids_1T = torch.from_numpy(ids_BS[valid_BS])[None].to(device)
    pos_1T = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths_B.tolist()]))[None].to(device)
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths_B)]).astype(np.int32)).to(device)
    max_len = int(lengths_B.max())
    return {"input_ids_BS": ids_1T, "position_ids_BS": pos_1T, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": max_len, "max_length_k": max_len}


def run_target(trunk, ids_BS: np.ndarray, lengths_B: np.ndarray, device: torch.device, packed: bool) -> torch.Tensor:
    """[B, S, D] features of a padded job on `device`, computed padded or packed."""
    if not packed:
        ids = torch.from_numpy(ids_BS).to(device)
        attn_BS = (torch.arange(ids.shape[1])[None, :] < torch.from_numpy(lengths_B)[:, None]).long().to(device)
        return trunk.features(ids, attn_BS)
    # Inputs and row indices go to the device before the forward: a copy from pageable host memory waits
    # for the stream, and after the forward it would hold this thread until the forward is done.
    inputs, rows_T = packed_inputs(ids_BS, lengths_B, device), padded_rows(ids_BS.shape, lengths_B, device)
    feats_1TD = trunk.features(**inputs)
    return unpack_features(feats_1TD[0], ids_BS.shape, rows_T)


def padded_rows(shape_BS: tuple[int, int], lengths_B: np.ndarray, device: torch.device) -> torch.Tensor:
    """Row of each packed token in the flattened [B * S] padded layout, computed on the host."""
    B, S = shape_BS
    return torch.from_numpy(np.flatnonzero(np.arange(S)[None, :] < np.asarray(lengths_B)[:, None])).to(device)


def unpack_features(feats_TD: torch.Tensor, shape_BS: tuple[int, int], rows_T: torch.Tensor) -> torch.Tensor:
    """Packed [T, D] rows back to right-padded [B, S, D] (zeros past each length). No boolean mask, so nothing
    waits on the device (and it runs on meta tensors, for the flops bench)."""
    B, S = shape_BS
    feats_BSD = feats_TD.new_zeros(B, S, feats_TD.shape[-1])
    feats_BSD.view(B * S, -1).index_copy_(0, rows_T, feats_TD)
    return feats_BSD


def to_host_async(feats: torch.Tensor) -> tuple[torch.Tensor, object | None]:
    """(host tensor, CUDA event to wait on). CUDA: pinned memory, copied on a side stream; CPU: as it is."""
    if feats.device.type != "cuda":
        return feats, None
    copy_stream = _copy_stream(feats.device)
    host = torch.empty(feats.shape, dtype=feats.dtype, pin_memory=True)
    copy_stream.wait_stream(torch.cuda.current_stream(feats.device))  # the forward that wrote feats
    with torch.cuda.stream(copy_stream):
        host.copy_(feats, non_blocking=True)
        done = torch.cuda.Event()
        done.record(copy_stream)
    feats.record_stream(copy_stream)  # keep the device buffer alive until the copy has read it
    return host, done


_COPY_STREAMS: dict = {}


def _copy_stream(device: torch.device):
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


@dataclass
class PendingBatch:
    """A job whose forward is done and whose features may still be on their way to the host."""

    job_id: int
    host_feats: torch.Tensor
    done: object | None  # torch.cuda.Event, or None when nothing is pending
    ids_BS: np.ndarray
    mask_BS: np.ndarray
    lengths_B: np.ndarray
    host_scales: torch.Tensor | None = None  # FP8 features' per-token scales (copied before `done`)

    def result(self) -> HiddenBatch:
        if self.done is not None:
            self.done.synchronize()  # releases the GIL: the next job's forward runs meanwhile
        return pack_hidden(self.job_id, self.host_feats, self.ids_BS, self.mask_BS, self.lengths_B, self.host_scales)


def start_job(trunk, seqs: list[tuple[np.ndarray, np.ndarray]], job_id: int, device: torch.device,
              packed: bool | None = None, feature_dtype: str = "bfloat16") -> PendingBatch:
    """Run one job's forward and start its host copy. `packed=None` decides by device and attention backend.
    `feature_dtype="float8_e4m3"` encodes the features on the device first (half the bytes to copy)."""
    ids_BS, mask_BS, lengths_B = pad_sequences(seqs)
    if packed is None:
        packed = use_packing(trunk.model, device)
    with torch.inference_mode():
        feats_BSD = run_target(trunk, ids_BS, lengths_B, device, packed)
        scales = None
        if feature_dtype == FP8_NAME:
            feats_BSD, scales_BS = encode_fp8(feats_BSD)
            scales, _ = to_host_async(scales_BS)  # same side stream, queued before the features' event
        host, done = to_host_async(feats_BSD)
    return PendingBatch(job_id, host, done, ids_BS, mask_BS, lengths_B, scales)


def pack_hidden(job_id: int, feats_BSD: torch.Tensor, ids_BS: np.ndarray, mask_BS: np.ndarray,
                lengths_B: np.ndarray, scales_BS: torch.Tensor | None = None) -> HiddenBatch:
    """Features to numpy: bf16 as its raw uint16 bits (numpy has no bf16), FP8 as uint8 codes with their
    per-token scales, others as they are."""
    feats = feats_BSD.detach().cpu().contiguous()
    if scales_BS is not None:
        return HiddenBatch(job_id=job_id, hidden_BSD=feats.numpy(), hidden_dtype=FP8_NAME, input_ids_BS=ids_BS,
                           loss_mask_BS=mask_BS, lengths_B=lengths_B,
                           hidden_scale_BS=scales_BS.detach().cpu().float().contiguous().numpy())
    if feats.dtype == torch.bfloat16:
        hidden, dtype = feats.view(torch.int16).numpy().view(np.uint16), "bfloat16"
    elif feats.dtype == torch.float16:
        hidden, dtype = feats.numpy(), "float16"
    else:
        hidden, dtype = feats.float().numpy(), "float32"
    return HiddenBatch(job_id=job_id, hidden_BSD=hidden, hidden_dtype=dtype, input_ids_BS=ids_BS,
                       loss_mask_BS=mask_BS, lengths_B=lengths_B)


def job_hidden_batch(target, seqs: list[tuple[np.ndarray, np.ndarray]], job_id: int, layer_ids: list[int],
                     device: torch.device, packed: bool | None = None, feature_dtype: str = "bfloat16") -> HiddenBatch:
    """One target job, synchronously: `target` is a `TargetTrunk` or an HF causal LM (wrapped for the call)."""
    from app.model.target_trunk import TargetTrunk

    trunk = target if isinstance(target, TargetTrunk) else TargetTrunk(target, layer_ids)
    try:
        return start_job(trunk, seqs, job_id, device, packed, feature_dtype).result()
    finally:
        if trunk is not target:
            trunk.remove()
