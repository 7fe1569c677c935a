"""What a drafter page-locks (issue 37, item 3): its two staging buffers, sized to the run's largest payload,
made once and freed at the end; not the whole object store (200 GiB, ~40-100 s per process and rebuild).
pool.transport=nixl's receive buffers are pinned on CUDA and staged from in place."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import app.payload.nixl_receive as nr
from app.messages import HiddenBatch
from app.payload.staging import PayloadStager
from app.payload.transport import NixlPayload, payload_tensors, spec_of
from tests.helpers import hidden_batch


class _Event:
    def record(self, _stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class FakeRay:
    """register/deregister/set_target/get as Ray's NIXL calls behave: the get writes into the target views."""

    def __init__(self) -> None:
        self.registered, self.deregistered, self.sent, self.targets = [], [], {}, {}

    def register(self, buf):
        self.registered.append(buf.data_ptr())

    def deregister(self, buf):
        self.deregistered.append(buf.data_ptr())

    def set_target(self, ref, views):
        self.targets[ref] = list(views)

    def get(self, ref):
        views = self.targets.pop(ref)
        for v, t in zip(views, self.sent[ref]):
            v.copy_(t)
        return views

    def payload(self, hb: HiddenBatch, ref: str) -> NixlPayload:
        self.sent[ref] = payload_tensors(hb)
        return NixlPayload(hb.job_id, hb.hidden_dtype, tuple(spec_of(t) for t in self.sent[ref]), ref)


@pytest.fixture
def cuda_standins(monkeypatch):
    monkeypatch.setattr(torch.cuda, "stream", lambda _s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Event)


def test_a_cuda_stager_registers_no_object_store_by_default(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())  # no GPU needed to build one
    stager = PayloadStager(torch.device("cuda", 0), torch.bfloat16)
    assert stager.enabled and stager.store is None and stager.registration_s == 0.0


def test_the_staging_buffers_are_made_once_at_the_largest_payload_and_freed_on_close(monkeypatch, cuda_standins):
    made = []
    real = PayloadStager._allocate
    monkeypatch.setattr(PayloadStager, "_allocate", lambda self, n: made.append(n) or real(self, n))
    hbs = [hidden_batch(i, tokens=6 + i) for i in range(5)]
    largest = max(hb.hidden_BSD.nbytes for hb in hbs)
    stager = PayloadStager(torch.device("cpu"), torch.float32, side_stream=object(), max_bytes=largest)
    assert made == [largest, largest] and stager.buffer_bytes() == 2 * largest and stager.registration_s > 0
    ptrs = {b.data_ptr() for b in stager._pinned}
    for hb in hbs:
        batch = stager.stage(hb)
        assert torch.equal(batch.hidden_BSD, torch.from_numpy(hb.hidden_BSD.view(np.int16)).view(torch.bfloat16).float())
    assert made == [largest, largest] and {b.data_ptr() for b in stager._pinned} == ptrs  # reused, never remade
    stager.close()
    assert stager.buffer_bytes() == 0 and stager._held == [None, None]


def test_pinned_nixl_receive_buffers_are_staged_from_in_place_and_deregistered_at_close(monkeypatch, cuda_standins):
    pinned = []
    monkeypatch.setattr(nr, "allocate", lambda n, pin: pinned.append(pin) or torch.empty(n, dtype=torch.uint8))
    fake = FakeRay()
    rx = nr.NixlReceiver(fake.register, fake.deregister, fake.set_target, fake.get, pin=True)
    stager = PayloadStager(torch.device("cpu"), torch.float32, side_stream=object(), store=rx)
    for j in range(4):
        hb = hidden_batch(j)
        got = rx.receive(fake.payload(hb, f"r{j}"))
        assert rx.covers(got.hidden_BSD.ctypes.data, got.hidden_BSD.nbytes)
        staged = stager.stage(got)
        assert torch.equal(staged.hidden_BSD, torch.from_numpy(hb.hidden_BSD.view(np.int16)).view(torch.bfloat16).float())
    assert pinned == [True, True] and stager.direct == 4 and stager.buffer_bytes() == 0  # no staging copy made
    outside = np.zeros(16, np.uint8)
    assert not rx.covers(outside.ctypes.data, outside.nbytes)
    rx.close()
    assert sorted(fake.deregistered) == sorted(fake.registered) and rx.buffer_bytes() == 0
    unpinned = nr.NixlReceiver(fake.register, fake.deregister, fake.set_target, fake.get)
    got = unpinned.receive(fake.payload(hidden_batch(9), "r9"))
    assert not unpinned.covers(got.hidden_BSD.ctypes.data, 1)  # pageable: the device copy cannot read it by DMA


def test_the_gpu_benchs_transport_counts_the_registration_of_both_ways() -> None:
    """The direct way page-locks the store's mapping once, then reads every job from it; the copy way makes its
    two pinned buffers once, at the payload's size. Counted from the calls made, not from the times."""
    from app.bench.transport.gpu_staging import bench_transport, fields

    r = bench_transport(torch.device("cpu"), 2 * 2**20, repeats=2)
    assert r["equal"]
    assert r["direct_registrations"] == 1 and r["direct_registered_bytes"] >= r["nbytes"]  # the whole mapping
    assert r["direct_jobs"] == r["jobs"] == 4  # every direct job read in place, the first (registering) one too
    assert r["copy_buffer_bytes"] == 2 * r["nbytes"] and r["copy_registration_ms"] > 0
    assert {"transport_copy_registration_ms", "transport_direct_registration_ms"} <= set(fields(r))
