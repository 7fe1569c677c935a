"""Host-to-device staging of a drafter's next payload, off the compute thread.

On CUDA the prefetch thread copies the payload's features into a reused pinned buffer (two, used
in turn: one may still feed the batch being computed) and from there onto the GPU on a side stream,
non-blocking; the compute thread makes its stream wait for that copy's event before using the batch.
The small arrays (ids, loss mask, lengths) go along on the same stream, and so do their dtype
conversions: every device tensor of the batch is made on the side stream before the event, so none is
read before its copy lands, and the compute stream `record_stream`s them all. Their host copies stay
with the batch so anchors and labels are sampled on the host (no per-sequence device syncs).
On CPU nothing is staged: the compute thread converts the payload as before, reading the object
store's read-only view in place (no copy out of the store).

Registration (page-locking host memory for DMA) costs time in proportion to the bytes: the staging
buffers are the only memory a drafter registers, sized from the largest payload of the run
(`max_bytes`, the largest bucket's job) and allocated pinned once, when the stager is made, then reused
for every payload (`registration_s` counts it); `close` frees them. Page-locking the whole object store
instead (`StoreRegistration`, cudaHostRegister of every store mapping: 200 GiB in docker/rayjob.yaml) took
~40-100 s in every drafter process, at every group rebuild; it saves one host copy per payload, so it is
kept as an opt-in (`store=`, what the transport benches compare), not the default. A stager given a
`store` reads the views it covers in place: it holds the newest view until the next payload is staged,
then syncs its copy's event and lets it go. pool.transport=nixl's receive buffers are pinned on CUDA and
are such a store (app/payload/nixl_receive.py `NixlReceiver.covers`): fixed, reused, registered once.
"""
from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

COPY_CHUNK = 16 * 2**20  # below two of these a copy stays on one thread: the hand-off costs more than it saves
MAX_COPY_THREADS = 4  # a host copy saturates memory bandwidth with a few threads; more only take the CPUs


def staging_threads(num_cpus: float) -> int:
    """Threads for a drafter's staging copy: its CPU share (topology.cpus_per_drafter), 1 to 4. On the 2-core
    box at 640 MiB, two threads took the copy from 74 to 40 ms (python -m app.bench transport, mt_ rows)."""
    return max(1, min(MAX_COPY_THREADS, int(num_cpus)))


class PayloadStager:
    """Turns `HiddenBatch` payloads into device `TrainBatch`es; `stage` runs in the prefetch thread."""

    def __init__(self, device: torch.device, dtype: torch.dtype, side_stream=None, copy_threads: int = 1,
                 store=None, max_bytes: int = 0) -> None:
        """`side_stream`: a stand-in for the CUDA side stream; it turns the staging path on anywhere (a CPU
        test rehearses the CUDA path with it). `copy_threads`: threads for the host copy of a large payload
        (1: numpy's one-thread copy; python -m app.bench transport measures more). `store`: what says
        whether a view is in page-locked memory the device copy may read in place (`StoreRegistration`, or the
        nixl receiver); none by default: every payload is copied into a staging buffer. `max_bytes`: the run's
        largest payload; both staging buffers are allocated (pinned on CUDA) at that size now, once."""
        self.device, self.dtype = device, dtype
        self.enabled = device.type == "cuda" or side_stream is not None
        self._pinned: list[torch.Tensor | None] = [None, None]
        self._copied: list = [None, None]  # each buffer's last copy-out event
        self._held: list = [None, None]  # each turn's store view read in place, kept until its event is done
        self._turn = 0
        self._stream = side_stream if side_stream is not None else (
            torch.cuda.Stream(device=device) if self.enabled else None)
        self.store = store
        self.registration_s = 0.0  # seconds spent allocating (page-locking) staging buffers in this process
        self._pool = ThreadPoolExecutor(copy_threads - 1, thread_name_prefix="stage-copy") if copy_threads > 1 else None
        self.copy_threads = max(1, copy_threads)
        self.direct = 0  # payloads read in place from the registered store (no staging copy)
        if self.enabled and max_bytes > 0:
            for turn in (0, 1):
                self._pinned[turn] = self._allocate(max_bytes)

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
        """The payload's features as a host tensor the device copy can read by DMA, as int16 bits for bf16:
        the store's own view where it is page-locked (`store`), else a copy into the next staging buffer
        (pinned on CUDA). The host half of `stage`, which the transport bench times on CPU."""
        hidden_np = hb.hidden_BSD.view(np.int16) if hb.hidden_dtype == "bfloat16" else np.asarray(hb.hidden_BSD)
        with warnings.catch_warnings():  # the object store's buffers are read-only; we only read them
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(hidden_np)
        if self.store is not None and hidden_np.flags.c_contiguous and self.store.covers(
                hidden_np.ctypes.data, hidden_np.nbytes):
            self._next_turn()
            self._release(self._turn ^ 1)  # the view before: its copy is done (synced), let the store have it
            self._held[self._turn] = hb  # this view's memory stays mapped until its copy is done
            self.direct += 1
            return src
        buf = self._buffer(hidden_np.nbytes)
        host = buf[: hidden_np.nbytes].view(src.dtype).view(src.shape)
        # pageable (object store) -> pinned, on this thread. numpy's copy, not torch's copy_: measured on the
        # same 640 MiB, warm, one thread, np.copyto ran at 10.5 GB/s and Tensor.copy_ at 7.0 (int16; uint16 at
        # 0.85); python -m app.bench transport times this step as staging, and more threads as its mt_ rows.
        copy_into(host.numpy(), hidden_np, self._pool, self.copy_threads)
        return host

    def _next_turn(self) -> None:
        # Two turns (the prefetcher holds at most one batch ahead); before a turn is reused, the host waits
        # for its previous copy-out to have finished on the GPU, then lets go of the view it read.
        self._turn ^= 1
        self._release(self._turn)

    def _release(self, turn: int) -> None:
        # At most one store view is held, the newest: it is the payload being staged, leased and not yet
        # acked, so the store holds nothing for the stager beyond what the pool's byte budget counts.
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # long done in practice; never overwrite or free a live copy
        self._held[turn] = None

    def _buffer(self, nbytes: int) -> torch.Tensor:
        self._next_turn()
        buf = self._pinned[self._turn]
        if buf is None or buf.numel() < nbytes:  # a payload above max_bytes (or none given): grown, 1.25x
            self._pinned[self._turn] = None  # the old one goes first: never both at once
            buf = self._pinned[self._turn] = self._allocate(int(nbytes * 1.25))
        return buf

    def _allocate(self, nbytes: int) -> torch.Tensor:
        import time

        t0 = time.perf_counter()
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self.registration_s += time.perf_counter() - t0
        return buf

    def buffer_bytes(self) -> int:
        """Bytes of staging buffers this stager holds."""
        return sum(int(b.numel()) for b in self._pinned if b is not None)

    def close(self) -> None:
        """Wait for the copies in flight, drop the staging buffers and held views, stop the copy threads."""
        for turn in (0, 1):
            self._release(turn)
            self._copied[turn] = None
        self._pinned = [None, None]
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.device.type == "cuda":  # freed pinned blocks stay in torch's host cache until emptied
            empty = getattr(torch._C, "_accelerator_emptyHostCache", None) or getattr(torch._C, "_host_emptyCache", None)
            if empty is not None:
                empty()

    def ready(self, batch):
        """On the compute thread: make its stream wait for the batch's copy; returns the batch."""
        event = getattr(batch, "ready_event", None)
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            for t in (batch.input_ids_BS, batch.loss_mask_BS, batch.hidden_BSD, batch.lengths_B):
                t.record_stream(stream)  # memory made on the side stream, used on this one
        return batch


def copy_into(dst: np.ndarray, src: np.ndarray, pool: ThreadPoolExecutor | None, threads: int) -> None:
    """`np.copyto(dst, src)`, split into `threads` contiguous parts over `pool` (this thread copies the
    first) when the payload is large: numpy releases the GIL while it copies. Both C-contiguous."""
    n = src.nbytes
    if pool is None or threads < 2 or n < 2 * COPY_CHUNK or not (src.flags.c_contiguous and dst.flags.c_contiguous):
        np.copyto(dst, src)
        return
    d, s = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
    step = -(-n // threads)
    step = -(-step // 4096) * 4096  # page-aligned parts: no page is written by two threads
    rest = [pool.submit(np.copyto, d[lo:lo + step], s[lo:lo + step]) for lo in range(step, n, step)]
    np.copyto(d[:step], s[:step])
    for f in rest:
        f.result()


def plasma_ranges(maps_path: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """This process's writable shared-memory mappings of the node's object store, as (start, end)
    addresses. Shared memory only: a disk-backed fallback mapping is left alone."""
    try:
        with open(maps_path) as f:
            lines = [line.split()[0] for line in f if "/dev/shm/plasma" in line and "rw-s" in line]
    except OSError:
        return []
    return [tuple(int(x, 16) for x in r.split("-")) for r in lines]


class StoreRegistration:
    """Which host addresses lie in page-locked object-store memory. `register(addr, nbytes) -> bool`
    page-locks one mapping (`cuda_host_register` on CUDA); each mapping is tried once, when a view first
    falls outside the known ones (a worker maps the store when it first reads from it, so there is
    nothing to register at start). A mapping that failed is never tried again; its payloads are copied.
    Views that are not in the store at all (pool.transport=nixl's receive buffers) re-read the process's
    mappings at most every `rescan_s` seconds, not once per payload."""

    def __init__(self, register, maps_path: str = "/proc/self/maps", rescan_s: float = 5.0, clock=None) -> None:
        import time

        self._register, self.maps_path = register, maps_path
        self.ranges: list[tuple[int, int]] = []  # registered
        self.failed: list[tuple[int, int]] = []
        self.rescan_s, self._clock = rescan_s, clock or time.monotonic
        self._scanned_at: float | None = None

    def _inside(self, addr: int, nbytes: int, ranges) -> bool:
        return any(lo <= addr and addr + nbytes <= hi for lo, hi in ranges)

    def covers(self, addr: int, nbytes: int) -> bool:
        """True when [addr, addr + nbytes) is in a registered mapping (registering new mappings first)."""
        if self._inside(addr, nbytes, self.ranges):
            return True
        if self._inside(addr, nbytes, self.failed):
            return False
        now = self._clock()
        if self._scanned_at is not None and now - self._scanned_at < self.rescan_s:
            return False
        self._scanned_at = now
        for r in plasma_ranges(self.maps_path):
            if r not in self.ranges and r not in self.failed:
                (self.ranges if self._register(r[0], r[1] - r[0]) else self.failed).append(r)
        return self._inside(addr, nbytes, self.ranges)


def cuda_host_register(addr: int, nbytes: int) -> bool:
    """Page-lock [addr, addr + nbytes) for DMA from the current CUDA device (cudaHostRegister, default
    flags: the store is mapped read-write here, so the read-only flag, for read-only mappings, is not
    needed). Once per mapping and process: it pins the pages (faulting in any not yet populated). False,
    with the runtime's error cleared, where it fails (e.g. a locked-memory limit): such payloads are copied."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(addr, nbytes, 0)
    code = int(getattr(err, "value", err))
    if code != 0:
        _clear_cuda_error()
        warnings.warn(f"cudaHostRegister of the object store's mapping ({nbytes / 2**30:.1f} GiB) failed with "
                      f"CUDA error {code}; its payloads are staged by copy instead", RuntimeWarning, stacklevel=2)
    return code == 0


def _clear_cuda_error() -> None:
    # A failed cudaHostRegister leaves the runtime's last error set on this thread, and torch's next kernel
    # launch check would raise it as its own: clear it through the process's own libcudart, where one is loaded.
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "libcudart" in line}
        for lib in libs:
            ctypes.CDLL(lib).cudaGetLastError()
    except (OSError, AttributeError):
        pass


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in, writable, without touching its contents


def populate_object_store(maps_path: str = "/proc/self/maps") -> int:
    """Fault this process's mapping of the node's object store into its page tables once, so the first
    payloads at each store offset do not pay a minor page fault per 4 KiB page (Ray's own
    `preallocate_plasma_memory` populates only the raylet's mapping; every worker maps the store again).
    Returns the bytes populated (0 where the kernel or platform cannot: nothing changes then)."""
    import ctypes
    import ctypes.util

    ranges = plasma_ranges(maps_path)  # populating a disk-backed fallback mapping for write would dirty its pages
    if not ranges:
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    done = 0
    for lo, hi in ranges:
        if libc.madvise(lo, hi - lo, MADV_POPULATE_WRITE) == 0:
            done += hi - lo
    return done
