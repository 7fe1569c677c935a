"""How a job's payload travels from its target to a drafter: `pool.transport`.

- `object_store` (the default): `TargetActor.forward` returns the `HiddenBatch`; Ray copies its arrays
  into the node's object store and the pool owns that object (it outlives the target).
- `nixl`: Ray's direct tensor transport with its one-sided NIXL backend. The target `ray.put`s the
  payload's tensors with `_tensor_transport="nixl"` and returns a small `NixlPayload` (the ref, the
  tensors' shapes and dtypes) in place of the batch; the pool holds the ref to that as it holds a batch
  today and never reads it. The tensors stay in the target's own memory until every ref is gone (the
  pool drops its ref when the job is acked), and the drafter reads them straight out of the target's
  memory into a registered buffer of its own (`app/payload/nixl_receive.py`).

What this changes (measured on CPU with Ray 2.60 and nixl 1.5.1, issue 27):
- a target holds every unconsumed payload it produced: `pool.capacity_bytes` now bounds the targets'
  memory instead of the object store's (app/config/checks.py `check_target_memory`, app/pool/holdings.py);
- a target's death loses its unconsumed payloads (the ref's owner died): the drafter's fetch raises
  `OwnerDiedError`, an `ObjectLostError`, and that job goes back to the queue as a payload lost with a
  node does (actors/drafter_ops.py fetch_next, README faults table);
- the NIXL ref is put inside the target and handed on as a value: a `@ray.method(tensor_transport=...)`
  return handed on before it exists fails (NotImplementedError); `await` on such a ref is not supported,
  so the drafter gets it with a blocking `ray.get` in its prefetch thread;
- torch tensors only (numpy values break at `ray.get`) and no `torch.uint16` (torch 2.13 cannot pickle
  it): bf16 features travel as their int16 bits, FP8 as uint8 codes;
- the first use per process costs seconds (UCX start): the target warms it up while it loads.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.messages import HiddenBatch

TRANSPORTS = ("object_store", "nixl")
_ALIGN = 64  # bytes: each tensor of a payload starts on a cache line of the receive buffer


@dataclass(frozen=True)
class TensorSpec:
    """Shape and torch dtype name (`int16`, `uint8`, ...) of one tensor of a NIXL payload."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class NixlPayload:
    """What the pool holds for a job under `pool.transport=nixl`: the target-owned ref of the payload's
    tensors (hidden, input ids, loss mask, lengths, and FP8 scales when present, in that order) and their
    specs, so a drafter can lay out its receive buffer before the transfer."""

    job_id: int
    hidden_dtype: str
    specs: tuple[TensorSpec, ...]
    ref: Any  # ray.ObjectRef of list[torch.Tensor], owned by the target that produced it

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def payload_tensors(hb: HiddenBatch) -> list:
    """The batch's arrays as torch tensors sharing their memory, in `NixlPayload` order. bf16 features are
    numpy uint16 bits; they travel as int16 (same bits), since torch cannot pickle torch.uint16."""
    import torch

    hidden = hb.hidden_BSD.view(np.int16) if hb.hidden_BSD.dtype == np.uint16 else hb.hidden_BSD
    arrays = [hidden, hb.input_ids_BS, hb.loss_mask_BS, hb.lengths_B]
    if hb.hidden_scale_BS is not None:
        arrays.append(hb.hidden_scale_BS)
    return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]


def spec_of(t) -> TensorSpec:
    return TensorSpec(tuple(int(n) for n in t.shape), str(t.dtype).removeprefix("torch."))


def put_payload(hb: HiddenBatch) -> tuple[NixlPayload, list]:
    """In the target: put the batch's tensors for NIXL transport. Returns the payload to hand to the pool
    and the tensors put (the target's `HeldPayloads` watches them to count what it still holds)."""
    import ray

    tensors = payload_tensors(hb)
    ref = ray.put(tensors, _tensor_transport="nixl")
    return NixlPayload(hb.job_id, hb.hidden_dtype, tuple(spec_of(t) for t in tensors), ref), tensors


def layout(specs: tuple[TensorSpec, ...]) -> tuple[list[int], int]:
    """Byte offsets of each tensor in a receive buffer (each aligned), and the bytes the buffer needs."""
    offsets, end = [], 0
    for s in specs:
        offsets.append(end)
        end += -(-s.nbytes // _ALIGN) * _ALIGN
    return offsets, end


def hidden_batch_from(payload: NixlPayload, tensors: list) -> HiddenBatch:
    """The received tensors as the `HiddenBatch` the drafter's staging takes (numpy views, no copy; bf16
    features back to their uint16 view)."""
    arrays = [t.numpy() for t in tensors]
    hidden = arrays[0].view(np.uint16) if payload.hidden_dtype == "bfloat16" else arrays[0]
    return HiddenBatch(job_id=payload.job_id, hidden_BSD=hidden, hidden_dtype=payload.hidden_dtype,
                       input_ids_BS=arrays[1], loss_mask_BS=arrays[2], lengths_B=arrays[3],
                       hidden_scale_BS=arrays[4] if len(arrays) > 4 else None)


class HeldPayloads:
    """A target's count of the payloads it still holds for NIXL readers: each one stays in this process
    until its last ref is gone (the pool drops its ref at the ack). Weak references to the tensors put, so
    counting never keeps a payload alive, and a payload counts as held exactly while its memory is: a
    tensor's weak reference dies when the last holder (Ray's tensor store, or anything else) lets go."""

    def __init__(self) -> None:
        self._held: list[tuple[int, weakref.ref, int]] = []

    def add(self, job_id: int, tensors: list) -> None:
        self._forget_freed()  # the list stays as short as what is held (a few jobs), however long the run
        self._held.append((job_id, weakref.ref(tensors[0]), sum(int(t.nbytes) for t in tensors)))

    def held(self) -> tuple[list[int], int]:
        """(job ids, bytes) still held."""
        self._forget_freed()
        return [j for j, _, _ in self._held], sum(n for _, _, n in self._held)

    def _forget_freed(self) -> None:
        self._held = [h for h in self._held if h[1]() is not None]


def warm_up_nixl() -> None:
    """Start this process's NIXL agent now (seconds, once per process) rather than on the first payload."""
    from ray.experimental.rdt.util import get_tensor_transport_manager

    get_tensor_transport_manager("NIXL").get_nixl_agent()
