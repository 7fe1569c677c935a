"""Host-to-device staging of a drafter's next payload, off the compute thread.

On CUDA the prefetch thread copies the payload's features into a reused pinned buffer (two, used
in turn: one may still feed the batch being computed) and from there onto the GPU on a side stream,
non-blocking; the compute thread makes its stream wait for that copy's event before using the batch.
The small arrays (ids, loss mask, lengths) go along on the same stream, and so do their dtype
conversions: every device tensor of the batch is made on the side stream before the event, so none is
read before its copy lands, and the compute stream `record_stream`s them all. Their host copies stay
with the batch so anchors and labels are sampled on the host (no per-sequence device syncs).
On CPU nothing is staged: the compute thread converts the payload as before.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch


class PayloadStager:
    """Turns `HiddenBatch` payloads into device `TrainBatch`es; `stage` runs in the prefetch thread."""

    def __init__(self, device: torch.device, dtype: torch.dtype, side_stream=None) -> None:
        """`side_stream`: a stand-in for the CUDA side stream; it turns the staging path on anywhere (a CPU
        test rehearses the CUDA path with it)."""
        self.device, self.dtype = device, dtype
        self.enabled = device.type == "cuda" or side_stream is not None
        self._pinned: list[torch.Tensor | None] = [None, None]
        self._copied: list = [None, None]  # each buffer's last copy-out event
        self._turn = 0
        self._stream = side_stream if side_stream is not None else (
            torch.cuda.Stream(device=device) if self.enabled else None)

    def stage(self, hb):
        """The payload as a device TrainBatch whose copy is in flight (CUDA), or `hb` unchanged (CPU)."""
        if not self.enabled or hb is None:
            return hb
        from app.model.loss import TrainBatch

        host = self.stage_host(hb)
        scales = hb.hidden_scale_BS
        with torch.cuda.stream(self._stream):  # copies and conversions alike, all before the event
            dev = host.to(self.device, non_blocking=True)
            if hb.hidden_dtype == "float8_e4m3":  # codes cast back with their per-token scales, on the device
                from app.model.feature_codec import decode_fp8

                hidden = decode_fp8(dev, torch.from_numpy(np.array(scales)).to(self.device, non_blocking=True),
                                    self.dtype)
            else:
                hidden = (dev.view(torch.bfloat16) if hb.hidden_dtype == "bfloat16" else dev).to(self.dtype)
            ids, mask, lengths = (torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)
                                  for a in (hb.input_ids_BS, hb.loss_mask_BS, hb.lengths_B))
            ids, mask, lengths = ids.long(), mask.float(), lengths.long()
            event = torch.cuda.Event()
            event.record(self._stream)
        self._copied[self._turn] = event
        batch = TrainBatch(input_ids_BS=ids, loss_mask_BS=mask, hidden_BSD=hidden,
                           lengths_B=lengths, input_ids_host=np.asarray(hb.input_ids_BS),
                           loss_mask_host=np.asarray(hb.loss_mask_BS), lengths_host=np.asarray(hb.lengths_B))
        batch.ready_event = event
        return batch

    def stage_host(self, hb) -> torch.Tensor:
        """The payload's features copied out of the object store into the next staging buffer (pinned on
        CUDA), as int16 bits for bf16; the host half of `stage`, which the transport bench times on CPU."""
        hidden_np = hb.hidden_BSD.view(np.int16) if hb.hidden_dtype == "bfloat16" else np.asarray(hb.hidden_BSD)
        buf = self._buffer(hidden_np.nbytes)
        with warnings.catch_warnings():  # the object store's buffers are read-only; we only read them
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(hidden_np)
        host = buf[: hidden_np.nbytes].view(src.dtype).view(src.shape)
        # pageable (object store) -> pinned, on this thread. numpy's copy, not torch's copy_: measured on the
        # same 640 MiB, warm, one thread, np.copyto ran at 10.5 GB/s and Tensor.copy_ at 7.0 (int16; uint16 at
        # 0.85), and a second thread did not pay (python -m app.bench transport times this step as staging).
        np.copyto(host.numpy(), hidden_np)
        return host

    def _buffer(self, nbytes: int) -> torch.Tensor:
        # Two buffers in turn (the prefetcher holds at most one batch ahead); before a buffer is
        # refilled, the host waits for its previous copy-out to have finished on the GPU.
        self._turn ^= 1
        if self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()  # long done in practice; never overwrite a live copy
        buf = self._pinned[self._turn]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(int(nbytes * 1.25), dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            self._pinned[self._turn] = buf
        return buf

    def ready(self, batch):
        """On the compute thread: make its stream wait for the batch's copy; returns the batch."""
        event = getattr(batch, "ready_event", None)
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            for t in (batch.input_ids_BS, batch.loss_mask_BS, batch.hidden_BSD, batch.lengths_B):
                t.record_stream(stream)  # memory made on the side stream, used on this one
        return batch


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in, writable, without touching its contents


def populate_object_store(maps_path: str = "/proc/self/maps") -> int:
    """Fault this process's mapping of the node's object store into its page tables once, so the first
    payloads at each store offset do not pay a minor page fault per 4 KiB page (Ray's own
    `preallocate_plasma_memory` populates only the raylet's mapping; every worker maps the store again).
    Returns the bytes populated (0 where the kernel or platform cannot: nothing changes then)."""
    import ctypes
    import ctypes.util

    try:
        with open(maps_path) as f:
            # Shared memory only: populating a disk-backed fallback mapping for write would dirty its pages.
            ranges = [line.split()[0] for line in f if "/dev/shm/plasma" in line and "rw-s" in line]
    except OSError:
        return 0
    if not ranges:
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    done = 0
    for r in ranges:
        lo, hi = (int(x, 16) for x in r.split("-"))
        if libc.madvise(lo, hi - lo, MADV_POPULATE_WRITE) == 0:
            done += hi - lo
    return done
