"""A drafter's end of `pool.transport=nixl` (see app/payload/transport.py): a payload read straight out of its
target's memory into a buffer of this process, then handed to the same staging as an object-store payload.

Two receive buffers, used in turn: the prefetch thread fills one while the batch received into the other
may still be in use (the staging copies out of it on CUDA; on CPU the compute thread's `TrainBatch`
conversion does, at the start of the next micro-step). Each buffer is touched (zero-filled) and registered
with NIXL once and reused for every job that fits, and grown (1.25x) for one that does not: receiving into
fresh memory costs page faults and a registration per job (measured on CPU, 640 MB: 1.1-1.7 s into
fresh memory, 0.35-0.54 s into a touched, registered one). On CUDA (`pin`) the buffers are also
page-locked, so the staging reads them in place by DMA (`covers`: the stager's `store`) instead of copying
them into its own staging buffer first; `registration_s` counts what making them cost.

The fetch is a blocking `ray.get` (Ray does not support `await` on a NIXL ref); it runs in the drafter's
prefetch thread. A target that died before the read raises `OwnerDiedError` (an `ObjectLostError`) there,
which the drafter's `fetch_next` turns into a re-queued job.
"""
from __future__ import annotations

from app.payload.transport import NixlPayload, hidden_batch_from, layout


class NixlReceiver:
    """Turns a pulled payload into a `HiddenBatch`: a `NixlPayload` is read into the next receive buffer,
    anything else (an object-store `HiddenBatch`) passes through. `register`, `set_target` and `get` are
    Ray's (`register_nixl_memory`, `set_target_for_ref`, `ray.get`), injected so the layout and the turns
    are tested without Ray."""

    def __init__(self, register=None, deregister=None, set_target=None, get=None, pin: bool = False) -> None:
        self._ray = (register, deregister, set_target, get)
        self.pin = pin  # page-locked receive buffers (CUDA): the device copy reads them in place
        self.registration_s = 0.0
        self._buffers: list = [None, None]
        self._turn = 0
        self.jobs = 0
        self.copied = 0  # jobs Ray did not land in our buffer (it allocated and we took its tensors): 0 expected

    def receive(self, pulled):
        if not isinstance(pulled, NixlPayload):
            return pulled
        register, deregister, set_target, get = self._calls()
        offsets, need = layout(pulled.specs)
        self._turn ^= 1
        buf = self._buffers[self._turn]
        if buf is None or buf.numel() < need:
            buf = self._grow(need, register, deregister)
        views = [_view(buf, off, spec) for off, spec in zip(offsets, pulled.specs)]
        set_target(pulled.ref, views)  # Ray keeps weak refs: `views` must live until the get returns
        tensors = list(get(pulled.ref))
        if any(t.data_ptr() != v.data_ptr() for t, v in zip(tensors, views)):
            self.copied += 1
        self.jobs += 1
        return hidden_batch_from(pulled, tensors)

    def _grow(self, need: int, register, deregister):
        import time

        import torch

        old = self._buffers[self._turn]
        if old is not None:
            deregister(old)
            self._buffers[self._turn] = None
        t0 = time.perf_counter()
        buf = allocate(int(need * 1.25), self.pin)
        buf.fill_(0)  # touch every page now, not during a transfer
        register(buf)
        self.registration_s += time.perf_counter() - t0
        self._buffers[self._turn] = buf
        return buf

    def covers(self, addr: int, nbytes: int) -> bool:
        """True when [addr, addr + nbytes) lies in one of the pinned receive buffers (the stager's `store`)."""
        return self.pin and any(b is not None and b.data_ptr() <= addr and addr + nbytes <= b.data_ptr() + b.numel()
                                for b in self._buffers)

    def close(self) -> None:
        """Deregister and drop the receive buffers (the drafter's shutdown)."""
        if all(b is None for b in self._buffers):
            return
        _, deregister, _, _ = self._calls()
        for i, b in enumerate(self._buffers):
            if b is not None:
                deregister(b)
            self._buffers[i] = None

    def buffer_bytes(self) -> int:
        return sum(int(b.numel()) for b in self._buffers if b is not None)

    def _calls(self):
        register, deregister, set_target, get = self._ray
        if None in self._ray:
            import ray
            from ray.experimental import deregister_nixl_memory, register_nixl_memory, set_target_for_ref

            register = register or register_nixl_memory
            deregister = deregister or deregister_nixl_memory
            set_target = set_target or set_target_for_ref
            get = get or ray.get
        return register, deregister, set_target, get


def allocate(nbytes: int, pin: bool):
    """A receive buffer of `nbytes`, page-locked when `pin` (CUDA)."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def _view(buf, offset: int, spec):
    import torch

    dtype = getattr(torch, spec.dtype)
    nbytes = spec.nbytes
    return buf[offset: offset + nbytes].view(dtype).view(spec.shape)
