"""The two ends of the payload path `python -m app.bench transport` times (app/bench/transport/object_store.py):
a TargetActor-shaped producer that runs the target's own payload code on features it keeps, and a
consumer that does a drafter rank's prefetch work with the real `fetch_next` and `PayloadStager`.
"""
from __future__ import annotations

import time

import numpy as np


class FixedTrunk:
    """A stand-in for `TargetTrunk`: the same features every job (the bench times the payload, not the
    forward). Fresh memory per job would time the allocator's page faults instead, which a real target
    pays once for its reused activations."""

    def __init__(self, feats) -> None:
        self.feats, self.model = feats, None

    def features(self, ids_BS, attn_BS):
        return self.feats


class TransportProducer:
    """TargetActor-shaped: `forward(job) -> (ItemMeta, HiddenBatch)` through the target's own payload code."""

    def __init__(self, num_seqs: int, seq_len: int, width: int, device: str, feature_dtype: str = "bfloat16") -> None:
        import torch

        from app.devices import pick_device

        self.device = pick_device(device)
        g = torch.Generator().manual_seed(0)
        feats = torch.randn(num_seqs, seq_len, width, generator=g).to(torch.bfloat16)
        self.trunk = FixedTrunk(feats.to(self.device))
        rng = np.random.default_rng(0)
        self.seqs = [(rng.integers(0, 1000, seq_len), np.ones(seq_len, np.uint8)) for _ in range(num_seqs)]
        self.marks: dict[int, tuple[float, float]] = {}
        self.feature_dtype = feature_dtype

    def ready(self, populate: bool = False) -> int:
        from app.payload.staging import populate_object_store

        return populate_object_store() if populate else 0

    def forward(self, job):
        from actors.target import batch_nbytes
        from app.data.target_forward import start_job
        from app.messages import ItemMeta

        t0 = time.perf_counter()
        batch = start_job(self.trunk, self.seqs, job.job_id, self.device, packed=False,
                          feature_dtype=self.feature_dtype).result()
        t1 = time.perf_counter()
        self.marks[job.job_id] = (t0, t1)
        meta = ItemMeta(job_id=job.job_id, bucket=job.bucket, num_seqs=len(self.seqs),
                        num_tokens=int(batch.lengths_B.sum()), loss_tokens=int(batch.loss_mask_BS.sum()),
                        nbytes=batch_nbytes(batch), target_id=0, forward_s=t1 - t0)
        return meta, batch

    def take_marks(self) -> dict[int, tuple[float, float]]:
        marks, self.marks = self.marks, {}
        return marks


class TransportConsumer:
    """A drafter rank's prefetch work: the real `fetch_next` and `PayloadStager`, timed. One stager per
    mode, chosen per job: copy (one thread), mt (`threads` threads), view (the store's view read in place,
    no staging copy)."""

    def __init__(self, device: str, modes: tuple[str, ...] = ("copy",), threads: int = 1) -> None:
        import torch

        from app.devices import pick_device
        from app.payload.staging import PayloadStager, StoreRegistration

        self.device = pick_device(device)
        self.stagers = {}
        for mode in modes:
            if mode == "view":  # CPU: the view is readable as it is; CUDA: the stager's own cudaHostRegister
                store = StoreRegistration(lambda addr, nbytes: True) if self.device.type != "cuda" else None
            else:  # registers nothing: every payload is copied into a staging buffer
                store = StoreRegistration(lambda addr, nbytes: False)
            self.stagers[mode] = PayloadStager(self.device, torch.bfloat16, store=store,
                                               copy_threads=threads if mode == "mt" else 1)
        self.acks: list[int] = []

    def ready(self, populate: bool = False) -> int:
        from app.payload.staging import populate_object_store

        return populate_object_store() if populate else 0

    def take_one(self, pool, generation: int, mode: str = "copy") -> dict:
        """Pull one item and stage it with `mode`'s stager; returns its job id, bytes and the times
        (perf_counter, one clock for every process on this machine)."""
        from actors.drafter_ops import fetch_next

        marks: dict[str, float] = {}
        stager = self.stagers[mode]
        direct0 = stager.direct

        def stage(hb):
            marks["got"] = time.perf_counter()
            if stager.enabled:  # CUDA: the whole stage, host copy and device copy
                batch = stager.stage(hb)
                batch.ready_event.synchronize()
            else:
                stager.stage_host(hb)
            marks["staged"] = time.perf_counter()
            scales = hb.hidden_scale_BS
            return hb.hidden_BSD.nbytes + (0 if scales is None else scales.nbytes)

        pulled, nbytes = fetch_next(pool, 0, generation, self.acks, stage,
                                    on_pulled=lambda: marks.__setitem__("pulled", time.perf_counter()))
        self.acks = [pulled.meta.job_id]  # ride on the next pull, as the drafter's do
        return {"job_id": pulled.meta.job_id, "nbytes": nbytes, "direct": stager.direct > direct0, "mode": mode,
                **marks}
