"""The transport part of `python -m app.bench gpu`: the drafter's host-to-device staging of one payload
read from shared memory laid out as Ray's object store is (a /dev/shm file mapped read-write, shared),
two ways side by side, with the stager the drafter runs (app/payload/staging.py PayloadStager):
- copy: the store's pageable view -> a pinned staging buffer (`np.copyto`, one thread) -> the device;
- direct: the mapping page-locked once (`StoreRegistration` + cudaHostRegister), the device copy reads
  the view by DMA, no staging copy.
Both give the same device tensor (`equal`, compared bit for bit), each timed to its copy's event. The
first direct job also pays the registration (`first_extra_ms`, once per mapping and process). No Ray here:
the Ray path with its seal is `python -m app.bench transport --device cuda`. On CPU (`--small`) both
ways run at small size with stand-in streams: the numbers are the CPU's, the equality is the point.
"""
from __future__ import annotations

import contextlib
import gc
import mmap
import os
import tempfile
import time

import numpy as np
import torch

FULL_BYTES = 640 * 2**20  # one default job's features (5 x 4096 x 2 bytes x 16K tokens)
SMALL_BYTES = 8 * 2**20
WIDTH = 5 * 4096


class _CpuEvent:
    def record(self, _stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _payload(view: np.ndarray, seq: int):
    from app.messages import HiddenBatch

    b, s = 1, view.shape[0] // WIDTH
    return HiddenBatch(job_id=seq, hidden_BSD=view.reshape(b, s, WIDTH), hidden_dtype="bfloat16",
                       input_ids_BS=np.zeros((b, s), np.int64), loss_mask_BS=np.ones((b, s), np.uint8),
                       lengths_B=np.array([s]))


def _time(stager, hb, device: torch.device) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    batch = stager.stage(hb)
    batch.ready_event.synchronize()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, batch.hidden_BSD


def bench_transport(device: torch.device, nbytes: int, repeats: int = 5) -> dict:
    """Median GB/s of staging one `nbytes` bf16 payload to `device`, copy vs direct; `equal` compares them."""
    from app.payload.staging import PayloadStager, StoreRegistration, cuda_host_register

    cuda = device.type == "cuda"
    nbytes -= nbytes % (WIDTH * 2)
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="plasma-bench-") as f:  # named as Ray names its store
        f.truncate(nbytes)
        with mmap.mmap(f.fileno(), nbytes, mmap.MAP_SHARED) as m, contextlib.ExitStack() as stack:
            view = np.frombuffer(m, dtype=np.uint16)
            view[:] = np.random.default_rng(0).integers(0, 2**16, view.size, dtype=np.uint16) & 0xBFFF  # finite bf16
            side = None
            if not cuda:  # the CUDA path with stand-ins (tests/test_gpu_readiness.py does the same)
                from unittest import mock

                side = object()
                stack.enter_context(mock.patch.object(torch.cuda, "stream", lambda _s: contextlib.nullcontext()))
                stack.enter_context(mock.patch.object(torch.cuda, "Event", _CpuEvent))
            lock = cuda_host_register if cuda else (lambda addr, n: True)
            registered: list[int] = []  # the bytes of each mapping the direct way page-locked

            def register(addr: int, n: int) -> bool:
                ok = lock(addr, n)
                registered.extend([n] if ok else [])
                return ok

            copy = PayloadStager(device, torch.bfloat16, side, store=StoreRegistration(lambda addr, n: False),
                                 max_bytes=nbytes)  # as a drafter: both pinned buffers made once, at the size
            direct = PayloadStager(device, torch.bfloat16, side, store=StoreRegistration(register))
            ro = view.view()  # the store's views are read-only to their readers
            ro.flags.writeable = False
            t0 = time.perf_counter()
            first, hidden_direct = _time(direct, _payload(ro, 0), device)
            copy_s, direct_s, equal = [], [], True
            for i in range(repeats + 1):  # one warm-up of the copy's pinned buffers
                dt, hidden_copy = _time(copy, _payload(ro, i), device)
                copy_s.append(dt)
                dt, hidden_direct = _time(direct, _payload(ro, i), device)
                direct_s.append(dt)
                equal = equal and torch.equal(hidden_copy, hidden_direct)
            out = {"copy_gbps": nbytes / float(np.median(copy_s[1:])) / 1e9,
                   "direct_gbps": nbytes / float(np.median(direct_s[1:])) / 1e9,
                   "first_extra_ms": 1e3 * (first - float(np.median(direct_s[1:]))),
                   "direct_jobs": direct.direct, "jobs": repeats + 2, "equal": equal, "nbytes": nbytes,
                   "copy_registration_ms": 1e3 * copy.registration_s,  # its two pinned buffers, made once
                   "copy_buffer_bytes": copy.buffer_bytes(),
                   "direct_registrations": len(registered), "direct_registered_bytes": sum(registered),
                   "wall_s": time.perf_counter() - t0}
            del hidden_copy, hidden_direct, ro, view, copy, direct  # the mapping closes with no export left
            gc.collect()
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.cudart().cudaHostUnregister(m_addr(m))
    return out


def m_addr(m: mmap.mmap) -> int:
    """The address of an mmap's first byte (for cudaHostUnregister)."""
    import ctypes

    buf = (ctypes.c_char * 1).from_buffer(m)
    try:
        return ctypes.addressof(buf)
    finally:
        del buf


def line(r: dict) -> str:
    return (f"transport: {r['nbytes'] / 2**20:.0f} MiB bf16 payload from shared memory to the device: copy via "
            f"pinned staging {r['copy_gbps']:.2f} GB/s, direct from the registered mapping {r['direct_gbps']:.2f} "
            f"GB/s ({r['direct_jobs']}/{r['jobs']} jobs direct, the first one {r['first_extra_ms']:.0f} ms longer: registration, once), "
            f"equal={r['equal']}; the copy path's pinned buffers took {r['copy_registration_ms']:.0f} ms to make, once")


def fields(r: dict) -> dict[str, str]:
    """The transport part's RESULT fields of `python -m app.bench gpu`."""
    return {"transport_copy_gbps": f"{r['copy_gbps']:.2f}", "transport_direct_gbps": f"{r['direct_gbps']:.2f}",
            "transport_direct_jobs": f"{r['direct_jobs']}/{r['jobs']}", "transport_equal": int(r["equal"]),
            "transport_direct_registration_ms": f"{max(0.0, r['first_extra_ms']):.0f}",
            "transport_copy_registration_ms": f"{r['copy_registration_ms']:.0f}"}


def available() -> bool:
    return os.path.isdir("/dev/shm")
