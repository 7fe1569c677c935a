"""`python -m app.bench transport_nixl`: one job's features target -> drafter with `pool.transport=nixl`
beside `pool.transport=object_store`, same sizes, same box, same run (issue 27 item 4).

Each size runs twice, fresh actors each, in this order:
- `store_*`: `pool.transport=object_store`, the path `python -m app.bench transport` measures (the batch
  returned to the real HSPoolActor and sealed in the object store, each process's store mapping populated:
  that bench's best), the drafter's real `fetch_next` and the stager's one-thread copy;
- `nixl_*`: the same TargetActor-shaped producer through the target's own NIXL code (`put_payload`: the
  tensors registered and kept in the producer, a small `NixlPayload` returned to the pool), and the same
  `fetch_next` with a `NixlReceiver` (a blocking get into two reused, pre-touched, registered buffers) and
  the same staging copy, as a rank does.
The producer gets fresh feature memory every job (written before its timer starts, as a forward writes its
output), so each job pays NIXL's registration of new memory as a real target would.

Split (median ms): produce+seal = forward start -> pull answered (nixl: the put, i.e. the registration,
and the small payload's return); fetch = the pull's answer -> payload in the drafter's memory (nixl: the
NIXL read itself, object store: a zero-copy view); staging = the stager's copy out of it.
On CPU expect no gain (UCX moves host memory with memcpy-like copies; the issue measured it no faster): the
figure that matters is a GPU's (`--device cuda`, one GPU each), where NIXL reads target GPU memory over
NVLink/RDMA without the object store's two host copies. RESULT: per size and transport, median and p99
GB/s end to end and the ratio nixl / store.
"""
from __future__ import annotations

import os
import time

import numpy as np

from app.bench.common import own_cluster, print_result

WARMUP = 2  # jobs per size before the timed ones (imports, NIXL's first use, the buffers' first touch)


class FreshTrunk:
    """A stand-in for `TargetTrunk` whose output is fresh memory every job, written before the job's timer
    starts (as a forward writes its output): the bench times the payload path, not the forward."""

    def __init__(self, base) -> None:
        self.base, self.feats, self.model = base, None, None

    def refill(self) -> None:
        self.feats = self.base.clone()

    def features(self, ids_BS, attn_BS):
        return self.feats


class PathProducer:
    """TargetActor-shaped: the target's own payload code, then `pool.transport`'s: the batch returned as it
    is (object_store) or its tensors `put_payload` and a `NixlPayload` returned (nixl)."""

    def __init__(self, num_seqs: int, seq_len: int, width: int, device: str, transport: str) -> None:
        import torch

        from app.devices import pick_device
        from app.payload.transport import HeldPayloads, warm_up_nixl

        self.device, self.transport = pick_device(device), transport
        g = torch.Generator().manual_seed(0)
        self.trunk = FreshTrunk(torch.randn(num_seqs, seq_len, width, generator=g).to(torch.bfloat16).to(self.device))
        rng = np.random.default_rng(0)
        self.seqs = [(rng.integers(0, 1000, seq_len), np.ones(seq_len, np.uint8)) for _ in range(num_seqs)]
        self.marks: dict[int, tuple[float, float]] = {}
        self.held = HeldPayloads()
        if transport == "nixl":
            warm_up_nixl()  # once per process, seconds: not timed (a target does it while loading)

    def ready(self) -> int:
        from app.payload.staging import populate_object_store

        return populate_object_store()  # the object store's best (bench transport's populate on); nixl: harmless

    def forward(self, job):
        from actors.target import batch_nbytes
        from app.data.target_forward import start_job
        from app.messages import ItemMeta
        from app.payload.transport import put_payload

        self.trunk.refill()
        t0 = time.perf_counter()
        payload = start_job(self.trunk, self.seqs, job.job_id, self.device, packed=False).result()
        nbytes = batch_nbytes(payload)
        if self.transport == "nixl":
            payload, tensors = put_payload(payload)
            self.held.add(job.job_id, tensors)
        t1 = time.perf_counter()
        self.marks[job.job_id] = (t0, t1)
        meta = ItemMeta(job_id=job.job_id, bucket=job.bucket, num_seqs=len(self.seqs),
                        num_tokens=len(self.seqs) * len(self.seqs[0][0]), loss_tokens=0, nbytes=nbytes,
                        target_id=0, forward_s=t1 - t0)
        return meta, payload

    def take_marks(self) -> tuple[dict[int, tuple[float, float]], int]:
        """The jobs' (start, payload handed over) times, and how many payloads it still holds (nixl)."""
        marks, self.marks = self.marks, {}
        return marks, len(self.held.held()[0])


class PathConsumer:
    """A drafter rank's prefetch work: the real `fetch_next` with a `NixlReceiver`, and the stager's copy."""

    def __init__(self, device: str) -> None:
        import torch

        from app.devices import pick_device
        from app.payload.nixl_receive import NixlReceiver
        from app.payload.staging import PayloadStager

        self.device = pick_device(device)
        self.stager = PayloadStager(self.device, torch.bfloat16)
        self.receiver = NixlReceiver()
        self.acks: list[int] = []

    def ready(self) -> int:
        from app.payload.staging import populate_object_store

        return populate_object_store()

    def take_one(self, pool, generation: int) -> dict:
        from actors.drafter_ops import fetch_next

        marks: dict[str, float] = {}

        def stage(hb):
            marks["got"] = time.perf_counter()
            if self.stager.enabled:
                self.stager.stage(hb).ready_event.synchronize()
            else:
                self.stager.stage_host(hb)
            marks["staged"] = time.perf_counter()
            return hb.hidden_BSD.nbytes

        pulled, nbytes = fetch_next(pool, 0, generation, self.acks, stage, receive=self.receiver.receive,
                                    on_pulled=lambda: marks.__setitem__("pulled", time.perf_counter()))
        self.acks = [pulled.meta.job_id]
        return {"job_id": pulled.meta.job_id, "nbytes": nbytes, "copied": self.receiver.copied, **marks}


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    """One thread's np.copyto between two warm buffers of `nbytes`, median."""
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / float(np.median(times)) / 1e9


def run_size(ray, label: str, num_seqs: int, seq_len: int, width: int, repeats: int, device: str,
             transport: str) -> dict:
    from actors.hs_pool import HSPoolActor, pool_max_concurrency
    from app.pool.stream import RunShape
    from app.config.schema import PoolConfig
    from app.messages import JobSpec

    nbytes_job = num_seqs * seq_len * width * 2
    opts = {"num_gpus": 1} if device == "cuda" else {}
    prod = ray.remote(PathProducer).options(**opts).remote(num_seqs, seq_len, width, device, transport)
    cons = ray.remote(PathConsumer).options(**opts).remote(device)
    cfg = PoolConfig(capacity=2, min_ready=1, jobs_in_flight_per_target=1, capacity_bytes=8 * nbytes_job + 2**20,
                     metrics_every_s=60.0, transport=transport)
    pool = ray.remote(HSPoolActor).options(max_concurrency=pool_max_concurrency(1, 1)).remote(
        cfg, 1, f"bench-transport-{transport}-{label}", runs={"": RunShape(1, 1)})
    ray.get([prod.ready.remote(), cons.ready.remote(), pool.ledger.remote()])
    ray.get(pool.add_target.remote(0, prod))
    generation = ray.get(pool.generation.remote(0))
    rows = []
    for i in range(repeats + WARMUP):
        job = JobSpec(i, 0, i, 0, tuple(range(num_seqs)), num_seqs * seq_len, nbytes_job + 2**16)
        taken = cons.take_one.remote(pool, generation)  # waits in its pull, as a drafter does
        ray.get(pool.add_jobs.remote([job]))
        rows.append(ray.get(taken))
    marks, still_held = ray.get(prod.take_marks.remote())
    for actor in (pool, prod, cons):
        ray.kill(actor)
    nbytes = rows[-1]["nbytes"]
    timed = rows[WARMUP:]
    e2e = [r["staged"] - marks[r["job_id"]][0] for r in timed]
    parts = {"produce_seal": [r["pulled"] - marks[r["job_id"]][0] for r in timed],
             "produce": [marks[r["job_id"]][1] - marks[r["job_id"]][0] for r in timed],
             "fetch": [r["got"] - r["pulled"] for r in timed],
             "staging": [r["staged"] - r["got"] for r in timed]}
    gbps = [nbytes / t / 1e9 for t in e2e]
    out = {"nbytes": nbytes, "median_gbps": float(np.median(gbps)), "p99_gbps": float(np.percentile(gbps, 1)),
           "memcpy_gbps": memcpy_gbps(nbytes, max(3, repeats)), "copied": rows[-1]["copied"],
           "held_at_end": still_held,  # nixl: the last job only (its ack would ride on a pull that never came)
           **{f"{k}_ms": 1e3 * float(np.median(v)) for k, v in parts.items()}}
    out["ratio"] = out["median_gbps"] / out["memcpy_gbps"]
    return out


def main(argv: list[str] | None = None) -> int:
    from app.bench.transport.object_store import chosen_sizes, payload_args

    args = payload_args("python -m app.bench transport_nixl", __doc__).parse_args(argv)
    import ray

    from app.config.checks import NIXL_INSTALL, nixl_installed

    if not nixl_installed():
        print(f"nixl is not installed: {NIXL_INSTALL}")
        return 2
    sizes, width, repeats, store = chosen_sizes(args)
    own_cluster(4, object_store_memory=store, _system_config={"preallocate_plasma_memory": True},
                **({"num_gpus": 2} if args.device == "cuda" else {}))
    print(f"object store vs nixl, one job at a time, {repeats} timed jobs per size after {WARMUP} warm-ups; "
          f"device {args.device}; pid {os.getpid()}")
    fields: dict[str, str] = {}
    for label, (b, s) in sizes.items():
        st = run_size(ray, label, b, s, width, repeats, args.device, "object_store")
        nx = run_size(ray, label, b, s, width, repeats, args.device, "nixl")
        for name, r in (("store", st), ("nixl", nx)):
            print(f"{label} {name}: {r['nbytes'] / 1e6:.0f} MB  e2e median {r['median_gbps']:.2f} GB/s  "
                  f"p99 {r['p99_gbps']:.2f} GB/s  memcpy {r['memcpy_gbps']:.2f} GB/s  ratio {r['ratio']:.3f}  "
                  f"split ms: produce+seal {r['produce_seal_ms']:.1f} (produce {r['produce_ms']:.1f}) "
                  f"fetch {r['fetch_ms']:.1f} staging {r['staging_ms']:.1f}")
        print(f"{label} nixl: payloads landed outside the receive buffers {nx['copied']}, "
              f"still held by the producer at the end {nx['held_at_end']} (the last, never acked)")
        k = label.lower()
        fields.update({f"store_{k}_median_gbps": f"{st['median_gbps']:.2f}", f"store_{k}_p99_gbps": f"{st['p99_gbps']:.2f}",
                       f"nixl_{k}_median_gbps": f"{nx['median_gbps']:.2f}", f"nixl_{k}_p99_gbps": f"{nx['p99_gbps']:.2f}",
                       f"nixl_{k}_over_store": f"{nx['median_gbps'] / st['median_gbps']:.2f}",
                       f"nixl_{k}_ratio": f"{nx['ratio']:.3f}", f"nixl_{k}_seal_ms": f"{nx['produce_seal_ms']:.0f}",
                       f"nixl_{k}_fetch_ms": f"{nx['fetch_ms']:.0f}", f"nixl_{k}_staging_ms": f"{nx['staging_ms']:.0f}",
                       f"store_{k}_fetch_ms": f"{st['fetch_ms']:.1f}", f"nixl_{k}_held_at_end": f"{nx['held_at_end']}"})
    ray.shutdown()
    print_result({"device": args.device, **fields})
    return 0
