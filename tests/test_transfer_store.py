"""The stager reads a page-locked object store in place (no staging copy) and gives the same batch as the
copy path; which mappings get registered, once each; the threaded host copy equals numpy's."""
from __future__ import annotations

import contextlib
import gc
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from app.model.loss import TrainBatch
from tests.helpers import hidden_batch
from app.payload.staging import COPY_CHUNK, PayloadStager, StoreRegistration, copy_into, plasma_ranges

MAPS = ("7f0000000000-7f0000100000 rw-s 00000000 00:1b 1 /dev/shm/plasmaXYZ (deleted)\n"
        "7f0000200000-7f0000201000 rw-s 00000000 00:1b 2 /tmp/ray/plasma_fallback (deleted)\n"
        "7f0000300000-7f0000301000 r-xp 00000000 00:1b 3 /usr/lib/libc.so.6\n")
SECOND = "7f1000000000-7f1000100000 rw-s 00000000 00:1b 4 /dev/shm/plasmaABC (deleted)\n"


def test_only_the_shared_memory_store_mappings_are_registered_each_once(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(MAPS)
    assert plasma_ranges(str(maps)) == [(0x7f0000000000, 0x7f0000100000)]
    calls, now = [], [0.0]
    reg = StoreRegistration(lambda addr, n: calls.append((addr, n)) or True, str(maps), rescan_s=5.0,
                            clock=lambda: now[0])
    assert reg.covers(0x7f0000000000 + 4096, 8192) and calls == [(0x7f0000000000, 0x100000)]
    assert reg.covers(0x7f0000000000, 0x100000) and len(calls) == 1  # known now: no second registration
    assert not reg.covers(0x7f00000ff000, 2 * 4096)  # runs past the mapping's end
    assert not reg.covers(0x7f0000200000, 16)  # the disk fallback: never registered, copied
    maps.write_text(MAPS + SECOND)  # the worker maps more of the store later: registered on a miss ...
    assert not reg.covers(0x7f1000000000, 64) and len(calls) == 1  # ... once the last scan is rescan_s old
    now[0] = 5.0
    assert reg.covers(0x7f1000000000, 64) and calls[-1] == (0x7f1000000000, 0x100000) and len(calls) == 2


def test_a_mapping_whose_registration_failed_is_not_tried_again(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(MAPS)
    calls = []
    reg = StoreRegistration(lambda addr, n: calls.append(addr) and False, str(maps), rescan_s=0.0)
    assert not reg.covers(0x7f0000000000, 64) and not reg.covers(0x7f0000000000, 64)
    assert len(calls) == 1 and reg.failed == [(0x7f0000000000, 0x7f0000100000)]


class _Covers:
    """A registration stand-in: every view is in page-locked memory (or none is)."""

    def __init__(self, answer: bool) -> None:
        self.answer = answer

    def covers(self, addr: int, nbytes: int) -> bool:
        return self.answer


class _Event:
    def __init__(self) -> None:
        self.synced = 0

    def record(self, _stream) -> None:
        pass

    def synchronize(self) -> None:
        self.synced += 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3"])
def test_reading_the_registered_store_in_place_gives_the_copy_paths_batch(monkeypatch, dtype):
    """The CUDA path with stand-in streams: the direct stager makes no staging buffer, holds only the newest
    view (the one before is let go after its copy's event), and its batch equals the copy path's and the
    plain conversion's."""
    monkeypatch.setattr(torch.cuda, "stream", lambda _s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    direct = PayloadStager(torch.device("cpu"), torch.float32, side_stream=object(), store=_Covers(True))
    copy = PayloadStager(torch.device("cpu"), torch.float32, side_stream=object(), store=_Covers(False))
    hbs = [hidden_batch(i, dtype=dtype, lengths=[6, 4]) for i in range(3)]
    first = weakref.ref(hbs[0].hidden_BSD)
    staged = [direct.stage(hb) for hb in hbs[:2]]
    copied = [copy.stage(hb) for hb in hbs[:2]]
    plain = [TrainBatch.from_hidden_batch(hb, torch.device("cpu"), torch.float32) for hb in hbs[:2]]
    assert direct.direct == 2 and direct._pinned == [None, None] and copy.direct == 0
    assert all(b is not None for b in copy._pinned)
    for a, b, c in zip(staged, copied, plain):
        for name in ("hidden_BSD", "input_ids_BS", "loss_mask_BS", "lengths_B"):
            x, y, z = getattr(a, name), getattr(b, name), getattr(c, name)
            assert x.dtype == y.dtype == z.dtype and torch.equal(x, y) and torch.equal(x, z), name
    event1 = staged[1].ready_event
    second = weakref.ref(hbs[1].hidden_BSD)
    del hbs[:2], staged, copied, plain
    gc.collect()
    assert first() is None and second() is not None  # only the newest view is held
    direct.stage(hbs[-1])  # the next payload: the one before is let go, after its copy's event
    gc.collect()
    assert event1.synced >= 1 and second() is None


def test_a_view_outside_the_store_is_copied_into_a_staging_buffer():
    hb = hidden_batch(0, lengths=[6, 4])
    stager = PayloadStager(torch.device("cpu"), torch.float32, store=_Covers(False))
    host = stager.stage_host(hb)
    assert stager.direct == 0 and host.data_ptr() != hb.hidden_BSD.ctypes.data
    assert torch.equal(host, torch.from_numpy(hb.hidden_BSD.view(np.int16)))


@pytest.mark.parametrize("nbytes", [3 * COPY_CHUNK + 12345, COPY_CHUNK // 2])
def test_the_threaded_copy_equals_numpys(nbytes):
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8).reshape(-1, 5 if nbytes % 5 == 0 else 1)
    src.flags.writeable = False
    dst = np.zeros_like(src)
    with ThreadPoolExecutor(2) as pool:
        copy_into(dst, src, pool, 3)
    assert np.array_equal(dst, src)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: cudaHostRegister of a shared-memory mapping")
def test_on_cuda_the_registered_mapping_is_read_in_place_and_equals_the_copy():
    from app.bench.transport.gpu_staging import bench_transport

    r = bench_transport(torch.device("cuda", 0), 8 * 2**20, repeats=2)
    assert r["equal"] and r["direct_jobs"] == r["jobs"]


def test_the_gpu_benchs_transport_part_compares_both_ways_on_cpu():
    from app.bench.transport.gpu_staging import bench_transport

    r = bench_transport(torch.device("cpu"), 2 * 2**20, repeats=2)
    assert r["equal"] and r["direct_jobs"] == r["jobs"] == 4 and r["copy_gbps"] > 0


def test_the_staging_copy_gets_the_drafters_cpu_share_in_threads_one_to_four():
    from app.payload.staging import staging_threads

    assert [staging_threads(c) for c in (0.3, 1, 2, 4, 16)] == [1, 1, 2, 4, 4]
