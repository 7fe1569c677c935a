"""pool.transport=nixl without Ray: the config key and its checks, the payload's tensors and their layout in the
drafter's receive buffers, the target's count of what it holds (app/payload/transport.py,
app/payload/nixl_receive.py). The Ray side: tests/test_nixl_ray.py."""
from __future__ import annotations

import gc
from dataclasses import replace

import numpy as np
import pytest
import torch

from app.config import checks
from app.config.checks import check_resources, check_target_memory, check_transport
from app.config.errors import ConfigError
from app.config.schema import Config, PoolConfig
from app.messages import HiddenBatch
from app.pool.holdings import check_object_store, payloads_in_store
from app.payload.transport import (HeldPayloads, NixlPayload, hidden_batch_from, layout,
                                payload_tensors, spec_of)
from app.payload.nixl_receive import NixlReceiver
from app.payload.staging import PayloadStager
from tests.helpers import hidden_batch

GIB = 2**30


def _cfg(**pool) -> Config:
    return replace(Config(), pool=replace(PoolConfig(), **pool))


def test_transport_key_defaults_to_the_object_store_and_refuses_others():
    assert PoolConfig().transport == "object_store"
    assert PoolConfig(transport="nixl").transport == "nixl"
    with pytest.raises(ValueError, match="pool.transport.*object_store, nixl"):
        PoolConfig(transport="gloo")


def test_nixl_not_installed_is_refused_before_actors_start_naming_the_fix(monkeypatch):
    with pytest.raises(ValueError, match=r"pool.transport=nixl .*not installed.*dflash-ray\[nixl\]"):
        check_transport("nixl", installed=False)
    check_transport("object_store", installed=False)  # the default never needs it
    monkeypatch.setattr(checks, "nixl_installed", lambda: False)
    with pytest.raises(ConfigError, match="nixl package is not installed"):
        check_resources(_cfg(transport="nixl"), {"CPU": 64.0, "GPU": 64.0}, use_gpu=False)
    check_resources(_cfg(), {"CPU": 64.0}, use_gpu=False)


def test_with_nixl_the_payloads_leave_the_object_store_and_count_in_the_targets_memory():
    job = GIB // 2
    assert payloads_in_store(_cfg(capacity_bytes=16 * GIB), job) == 16 * GIB
    assert payloads_in_store(_cfg(capacity_bytes=16 * GIB, transport="nixl"), job) == 0
    with pytest.raises(ConfigError, match="would spill"):
        check_object_store(_cfg(capacity_bytes=20 * GIB), job, 16 * GIB)
    check_object_store(_cfg(capacity_bytes=20 * GIB, transport="nixl"), job, 16 * GIB)  # not in the store now
    with pytest.raises(ConfigError, match=r"targets' own memory.*worker memory is 16 GiB.*pool.capacity_bytes"):
        check_target_memory(_cfg(capacity_bytes=20 * GIB, transport="nixl"), 16 * GIB)
    check_target_memory(_cfg(capacity_bytes=16 * GIB, transport="nixl"), 16 * GIB)
    check_target_memory(_cfg(capacity_bytes=20 * GIB), 16 * GIB)  # the object store path: the store's check
    check_target_memory(_cfg(capacity_bytes=20 * GIB, transport="nixl"), 0)  # Ray did not say
    # a small cluster's figures keep their digits instead of reading "0.0 GiB"
    with pytest.raises(ConfigError, match=r"\(0.0469 GiB\).*worker memory is 0.0312 GiB"):
        check_target_memory(_cfg(capacity_bytes=48 * 2**20, transport="nixl"), 32 * 2**20)


@pytest.mark.parametrize("fp8", [False, True])
def test_payload_tensors_share_the_batch_memory_and_come_back_as_the_same_batch(fp8):
    hb = hidden_batch(dtype="float8_e4m3" if fp8 else "bfloat16", read_only=False)
    tensors = payload_tensors(hb)
    assert [t.dtype for t in tensors][:4] == [torch.uint8 if fp8 else torch.int16, torch.int64, torch.uint8, torch.int64]
    assert len(tensors) == (5 if fp8 else 4)  # FP8 scales travel too
    assert tensors[0].data_ptr() == hb.hidden_BSD.ctypes.data  # no copy in the target
    payload = NixlPayload(hb.job_id, hb.hidden_dtype, tuple(spec_of(t) for t in tensors), ref=None)
    assert payload.nbytes == sum(t.nbytes for t in tensors)
    back = hidden_batch_from(payload, [t.clone() for t in tensors])
    assert back.hidden_BSD.dtype == hb.hidden_BSD.dtype and back.hidden_dtype == hb.hidden_dtype
    for a, b in [(back.hidden_BSD, hb.hidden_BSD), (back.input_ids_BS, hb.input_ids_BS),
                 (back.loss_mask_BS, hb.loss_mask_BS), (back.lengths_B, hb.lengths_B)]:
        np.testing.assert_array_equal(a, b)
    assert (back.hidden_scale_BS is None) == (not fp8)


def test_layout_aligns_every_tensor_and_sizes_the_buffer():
    specs = tuple(spec_of(t) for t in payload_tensors(hidden_batch(seqs=3, tokens=7, width=5, read_only=False)))
    offsets, need = layout(specs)
    assert offsets[0] == 0 and all(o % 64 == 0 for o in offsets)
    assert all(offsets[i] + specs[i].nbytes <= offsets[i + 1] for i in range(len(specs) - 1))
    assert need >= offsets[-1] + specs[-1].nbytes and need % 64 == 0


class FakeRay:
    """Stands in for register_nixl_memory / deregister / set_target_for_ref / ray.get: the 'transfer' writes
    the producer's tensors into the target views it was given, as NIXL does."""

    def __init__(self) -> None:
        self.registered: list[int] = []
        self.deregistered: list[int] = []
        self.sent: dict[str, list[torch.Tensor]] = {}
        self.targets: dict[str, list] = {}

    def register(self, buf):
        self.registered.append(buf.data_ptr())

    def deregister(self, buf):
        self.deregistered.append(buf.data_ptr())

    def set_target(self, ref, views):
        self.targets[ref] = [v for v in views]

    def get(self, ref):
        views = self.targets.pop(ref)
        for v, t in zip(views, self.sent[ref]):
            v.copy_(t)
        return views

    def payload(self, hb: HiddenBatch, ref: str) -> NixlPayload:
        tensors = payload_tensors(hb)
        self.sent[ref] = tensors
        return NixlPayload(hb.job_id, hb.hidden_dtype, tuple(spec_of(t) for t in tensors), ref)


def test_receiver_reads_into_two_reused_registered_buffers_in_turn_then_stages_as_today():
    fake = FakeRay()
    rx = NixlReceiver(fake.register, fake.deregister, fake.set_target, fake.get)
    stager = PayloadStager(torch.device("cpu"), torch.float32, side_stream=object())  # the CUDA path's host half
    ptrs = []
    batches = [hidden_batch(j, read_only=False) for j in range(6)]
    for j, hb in enumerate(batches):
        got = rx.receive(fake.payload(hb, f"ref{j}"))
        np.testing.assert_array_equal(got.hidden_BSD, hb.hidden_BSD)
        np.testing.assert_array_equal(got.input_ids_BS, hb.input_ids_BS)
        ptrs.append(got.hidden_BSD.ctypes.data)
        staged = stager.stage_host(got)  # the same staging as an object-store payload
        assert torch.equal(staged.view(torch.bfloat16),
                           torch.from_numpy(hb.hidden_BSD.view(np.int16)).view(torch.bfloat16))
    assert len(fake.registered) == 2 and fake.deregistered == []  # each buffer registered once, reused
    assert len(set(ptrs)) == 2 and ptrs[0] == ptrs[2] == ptrs[4] and ptrs[1] == ptrs[3] == ptrs[5]
    # the batch received just before stays intact while the next one lands (the other buffer)
    prev = rx.receive(fake.payload(batches[0], "a"))
    keep = prev.hidden_BSD.copy()
    rx.receive(fake.payload(batches[1], "b"))
    np.testing.assert_array_equal(prev.hidden_BSD, keep)
    assert rx.jobs == 8 and rx.copied == 0


def test_receiver_grows_a_buffer_for_a_larger_payload_and_passes_object_store_batches_through():
    fake = FakeRay()
    rx = NixlReceiver(fake.register, fake.deregister, fake.set_target, fake.get)
    rx.receive(fake.payload(hidden_batch(tokens=4, read_only=False), "a"))
    rx.receive(fake.payload(hidden_batch(tokens=4, read_only=False), "b"))
    small = rx.buffer_bytes()
    big = hidden_batch(3, tokens=64, read_only=False)
    got = rx.receive(fake.payload(big, "c"))
    np.testing.assert_array_equal(got.hidden_BSD, big.hidden_BSD)
    assert len(fake.deregistered) == 1 and len(fake.registered) == 3 and rx.buffer_bytes() > small
    hb = hidden_batch(read_only=False)
    assert rx.receive(hb) is hb  # pool.transport=object_store: unchanged, nothing registered
    assert len(fake.registered) == 3


def test_held_payloads_count_exactly_what_is_still_alive():
    held = HeldPayloads()
    keep = {j: payload_tensors(hidden_batch(j, read_only=False)) for j in range(3)}
    for j, ts in keep.items():
        held.add(j, ts)
    ids, nbytes = held.held()
    assert ids == [0, 1, 2] and nbytes == sum(t.nbytes for ts in keep.values() for t in ts)
    one = sum(t.nbytes for t in keep[1])
    del keep[1]
    gc.collect()
    ids, nbytes2 = held.held()
    assert ids == [0, 2] and nbytes2 == nbytes - one
