"""`python -m app.bench transport`: one target job's features from the target to the drafter's staging
buffer, through the project's own payload path, at real sizes, against a plain memcpy of the same bytes.

The path, end to end, one job at a time (no overlap, so each part is timed alone):
- produce: a TargetActor-shaped producer (`forward(job)` with `num_returns=2`, called by the real
  HSPoolActor, which owns the refs) runs the target's own payload code (`start_job` -> `PendingBatch.result`
  -> `pack_hidden`, `batch_nbytes`) on a features tensor it keeps (the forward itself is not measured:
  on CUDA this is the device-to-host copy, on CPU the features are already on the host);
- seal: Ray copies the returned numpy arrays into the object store when `forward` returns, then the
  pool sees the small meta and answers the drafter's waiting pull ("produce+seal" = forward start ->
  pull answered);
- fetch: `ray.get` of the payload ref (a read-only view of the store on the same node);
- staging: the drafter's `PayloadStager` copies the features out of the store into its staging buffer
  (pinned on CUDA; on CUDA the host-to-device copy follows and is timed too).
Both sides use the drafter's real `fetch_next` (actors/drafter_ops.py) and stager (app/payload/staging.py);
the two ends are `app/bench/transport/path_ends.py`.

memcpy: `np.copyto` of the same number of bytes between two warm buffers, one thread, in the same run:
the best one copy can do on this machine. The path makes at least two host copies (into the store, out of
it), so 0.5 x memcpy is what two copies at full memory speed give. One memcpy sample is taken after every
timed job, and the ratios of a size divide by the median of all its bf16 samples (one denominator per
size; on a shared box a busy neighbour moves every variant alike).

Variants, each its own row and RESULT keys, all with the store populated (after the `base_` row), taking
turns job by job on the same actors (copy, mt, view, copy, ...):
- (no prefix) the staging copy on one thread: the CUDA drafter's host half where the store is not
  page-locked, two full host copies: the like-for-like figure;
- `mt_`: the same copy over `--threads` threads (app/payload/staging.py copy_into), two copies;
- `view_`: no staging copy: the stager reads the store's view in place (`StoreRegistration`; on CPU the
  "registration" is a no-op, a CPU drafter reads the view as it is; on CUDA it is cudaHostRegister and the
  host-to-device copy reads the store by DMA), one full host copy (the seal). `view_*_direct` counts the
  timed jobs that really went without the copy (the view was inside the store's shared-memory mapping).

RESULT: per size, median and p99 GB/s end to end, the ratio of the median to memcpy, and the median
split (produce+seal, of it produce alone, fetch, staging) in ms. `--populate both` (the default) runs
each size first without (`base_*`) then with each process's own pre-fault of its store mapping. FP8
(`--fp8`) encodes on the producer's device: on CPU that encode is CPU work in "produce" (on a GPU it
is a few kernels), so compare FP8's staging and bytes here, and its end to end on a GPU.
`--quick` runs small payloads for the tests.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from app.bench.common import own_cluster, print_result
from app.bench.transport.path_ends import TransportConsumer, TransportProducer

# 5 target layers x 4096 hidden x 2 bytes per token: the default shapes (conf/default.yaml).
DEFAULT_WIDTH = 5 * 4096
SIZES_TOKENS = {"64MiB": (1, 1638), "160MiB": (1, 4096), "640MiB": (4, 4096)}  # (sequences, tokens each)
WARMUP = 2  # jobs per size before the timed ones: a drafter pays its two staging buffers' page faults once per run
QUICK_SIZES = {"1MiB": (1, 128), "4MiB": (2, 256)}  # at width 4096


def memcpy_seconds(nbytes: int, repeats: int) -> list[float]:
    """One thread's `np.copyto` between two warm buffers of `nbytes`."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)  # both touched: no page faults in the timed copies
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        out.append(time.perf_counter() - t0)
    return out


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def run_size(ray, label: str, num_seqs: int, seq_len: int, width: int, repeats: int, device: str,
             verbose: bool = False, feature_dtype: str = "bfloat16", populate: bool = False,
             modes: tuple[str, ...] = ("copy",), threads: int = 1) -> list[dict]:
    """One result per mode. The modes take turns job by job (copy, view, copy, view, ...) on the same
    actors, store and pool, and one memcpy sample is taken after each job: a busy neighbour slows them alike."""
    from actors.hs_pool import HSPoolActor, pool_max_concurrency
    from app.pool.stream import RunShape
    from app.config.schema import PoolConfig
    from app.messages import JobSpec

    bf16_bytes = num_seqs * seq_len * width * 2  # the features in bf16, whatever travels
    opts = {"num_gpus": 1} if device == "cuda" else {}
    prod = ray.remote(TransportProducer).options(**opts).remote(num_seqs, seq_len, width, device, feature_dtype)
    cons = ray.remote(TransportConsumer).options(**opts).remote(device, tuple(modes), threads)
    cfg = PoolConfig(capacity=2, min_ready=1, jobs_in_flight_per_target=1, capacity_bytes=8 * bf16_bytes + 2**20,
                     metrics_every_s=60.0)
    pool = ray.remote(HSPoolActor).options(max_concurrency=pool_max_concurrency(1, 1)).remote(
        cfg, 1, f"bench-transport-{label}", runs={"": RunShape(1, 1)})
    ray.get([prod.ready.remote(populate), cons.ready.remote(populate), pool.ledger.remote()])
    ray.get(pool.add_target.remote(0, prod))
    generation = ray.get(pool.generation.remote(0))
    src, dst = np.ones(bf16_bytes, np.uint8), np.zeros(bf16_bytes, np.uint8)
    np.copyto(dst, src)  # both touched: no page faults in the timed copies
    rows, mc = [], []
    n = len(modes)
    for i in range((repeats + WARMUP) * n):  # warm-ups: actor imports, and each stager's two buffers' first use
        job = JobSpec(i, 0, i, 0, tuple(range(num_seqs)), num_seqs * seq_len, bf16_bytes + 2**16)
        taken = cons.take_one.remote(pool, generation, modes[i % n])  # waits in its pull, as a drafter does
        ray.get(pool.add_jobs.remote([job]))
        rows.append(ray.get(taken))
        if i >= WARMUP * n:
            t0 = time.perf_counter()
            np.copyto(dst, src)
            mc.append(time.perf_counter() - t0)
    marks = ray.get(prod.take_marks.remote())
    for actor in (pool, prod, cons):
        ray.kill(actor)
    del src, dst
    nbytes = rows[-1]["nbytes"]  # what travelled: features (+ FP8 scales)
    mc = [t * nbytes / bf16_bytes for t in mc]  # the memcpy of the bytes in transit (FP8: half)
    out = []
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        parts: dict[str, list[float]] = {"e2e": [], "produce_seal": [], "produce": [], "fetch": [], "staging": []}
        for r in mine[WARMUP:]:
            t0, t1 = marks[r["job_id"]]
            parts["produce"].append(t1 - t0)  # the target's payload code alone (FP8: its encode, on CPU here)
            parts["e2e"].append(r["staged"] - t0)
            parts["produce_seal"].append(r["pulled"] - t0)
            parts["fetch"].append(r["got"] - r["pulled"])
            parts["staging"].append(r["staged"] - r["got"])
        if verbose:
            print(label, mode, "per job ms (produce+seal, fetch, staging):",
                  " ".join(f"{1e3 * a:.0f}/{1e3 * b:.1f}/{1e3 * c:.0f}"
                           for a, b, c in zip(parts["produce_seal"], parts["fetch"], parts["staging"])))
        gbps = [nbytes / s / 1e9 for s in parts["e2e"]]
        r = {"label": label, "nbytes": nbytes, "feature_dtype": feature_dtype, "mode": mode, "mc": mc,
             "direct": sum(r["direct"] for r in mine[WARMUP:]),  # timed jobs staged without the copy
             "features_gbps": bf16_bytes / float(np.median(parts["e2e"])) / 1e9, "median_gbps": percentile(gbps, 50),
             "p99_gbps": percentile(gbps, 1),  # the p99 of the time is the 1st percentile of the rate
             "memcpy_gbps": nbytes / float(np.median(mc)) / 1e9,
             **{f"{k}_ms": 1e3 * float(np.median(v)) for k, v in parts.items()},
             "p99_e2e_ms": 1e3 * percentile(parts["e2e"], 99),
             # the first jobs' seal: the first payloads of a fresh store, at offsets never written before
             "first_seal_ms": 1e3 * float(np.mean([r["pulled"] - marks[r["job_id"]][0] for r in rows[:WARMUP]]))}
        r["ratio"] = r["median_gbps"] / r["memcpy_gbps"]
        out.append(r)
    return out


def payload_args(prog: str, doc: str) -> argparse.ArgumentParser:
    """The options every payload-path bench takes (this one, `transport_nixl`): sizes, repeats, device."""
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small payloads, few repeats (the tests)")
    ap.add_argument("--repeats", type=int, default=12, help="timed jobs per size (after the warm-ups)")
    ap.add_argument("--sizes", default="", help="comma list of size labels (default: all)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (a GPU each for producer and consumer)")
    return ap


def chosen_sizes(args) -> tuple[dict[str, tuple[int, int]], int, int, int]:
    """(sizes, feature width, timed repeats, object-store bytes) for the parsed `payload_args`; the store
    holds two payloads (one leased, one landing) and the reader's view of the largest."""
    sizes = QUICK_SIZES if args.quick else SIZES_TOKENS
    width = 4096 if args.quick else DEFAULT_WIDTH
    if args.sizes:
        sizes = {k: v for k, v in sizes.items() if k in args.sizes.split(",")}
    repeats = 3 if args.quick else args.repeats
    largest = max(b * s * width * 2 for b, s in sizes.values())
    return sizes, width, repeats, max(256 * 2**20, int(3.5 * largest))


def main(argv: list[str] | None = None) -> int:
    ap = payload_args("python -m app.bench transport", __doc__)
    ap.add_argument("--prefault", choices=("on", "off"), default="on",
                    help="pre-fault the object store at start (Ray's preallocate_plasma_memory)")
    ap.add_argument("--populate", choices=("on", "off", "both"), default="both",
                    help="producer and consumer fault their own mapping of the store in at start "
                         "(app/payload/staging.py populate_object_store); both = each size without (base_*) "
                         "then with, fresh actors each, side by side in this run")
    ap.add_argument("--fp8", default="640MiB,4MiB",
                    help="sizes also run with model.feature_dtype=float8_e4m3 (comma list; '' for none)")
    ap.add_argument("--threads", type=int, default=2, help="threads of the mt_ variant's staging copy (1: no mt_ rows)")
    ap.add_argument("--variants", default="mt,view", help="comma list of the extra variants to run (mt, view; '' none)")
    ap.add_argument("--verbose", action="store_true", help="print every job's split")
    args = ap.parse_args(argv)
    import ray

    sizes, width, repeats, store = chosen_sizes(args)
    system = {"preallocate_plasma_memory": args.prefault == "on"}
    own_cluster(4, object_store_memory=store, _system_config=system,
                **({"num_gpus": 2} if args.device == "cuda" else {}))
    print(f"payload path, one job at a time, {repeats} timed jobs per size after {WARMUP} warm-ups; object store "
          f"{store / 2**20:.0f} MiB, pre-fault {args.prefault}, populate {args.populate}; device {args.device}; "
          f"pid {os.getpid()}")
    results = []
    pops = {"off": [False], "on": [True], "both": [False, True]}[args.populate]
    variants = [v for v in args.variants.split(",") if v and not (v == "mt" and args.threads < 2)]
    runs = [(label, "bfloat16", False, ("copy",)) for label in sizes if args.populate == "both"]
    runs += [(label, "bfloat16", pops[-1], ("copy", *variants)) for label in sizes]
    runs += [(label, "float8_e4m3", pops[-1], ("copy",)) for label in args.fp8.split(",") if label in sizes]
    base: dict[str, dict] = {}
    memcpy: dict[str, list[float]] = {}
    for label, feature_dtype, pop, modes in runs:
        b, s = sizes[label]
        for r in run_size(ray, label, b, s, width, repeats, args.device, args.verbose, feature_dtype, pop, modes,
                          args.threads):
            if feature_dtype == "bfloat16":
                memcpy.setdefault(label, []).extend(r["mc"] if r["mode"] == modes[0] else [])
            if args.populate == "both" and not pop:
                base[label] = r
            else:
                results.append(r)
            print(f"{label} {feature_dtype} {r['mode']} populate {'on' if pop else 'off'}: {r['nbytes'] / 1e6:.0f} MB "
                  f"in transit  e2e median {r['median_gbps']:.2f} GB/s  "
                  f"p99 {r['p99_gbps']:.2f} GB/s (p99 {r['p99_e2e_ms']:.0f} ms)  memcpy {r['memcpy_gbps']:.2f} GB/s  "
                  f"ratio {r['ratio']:.3f}  features (bf16 bytes) {r['features_gbps']:.2f} GB/s  "
                  f"split ms: produce+seal {r['produce_seal_ms']:.1f} (produce {r['produce_ms']:.1f}) "
                  f"fetch {r['fetch_ms']:.1f} staging {r['staging_ms']:.1f}")
    ray.shutdown()
    for r in [*results, *base.values()]:  # one bf16 memcpy per size: the median of all its samples in this run
        if r["feature_dtype"] == "bfloat16":
            r["memcpy_gbps"] = r["nbytes"] / float(np.median(memcpy[r["label"]])) / 1e9
            r["ratio"] = r["median_gbps"] / r["memcpy_gbps"]
    fields: dict[str, str] = {}
    for r in results:
        k = ("fp8_" if r["feature_dtype"] == "float8_e4m3" else "") + r["label"].lower()
        k = {"mt": "mt_", "view": "view_"}.get(r["mode"], "") + k
        fields.update({f"{k}_median_gbps": f"{r['median_gbps']:.2f}", f"{k}_p99_gbps": f"{r['p99_gbps']:.4f}",
                       f"{k}_ratio": f"{r['ratio']:.3f}", f"{k}_memcpy_gbps": f"{r['memcpy_gbps']:.2f}",
                       f"{k}_seal_ms": f"{r['produce_seal_ms']:.0f}", f"{k}_produce_ms": f"{r['produce_ms']:.0f}",
                       f"{k}_fetch_ms": f"{r['fetch_ms']:.1f}",
                       f"{k}_staging_ms": f"{r['staging_ms']:.0f}"})
        if r["feature_dtype"] == "float8_e4m3":
            fields.update({f"{k}_mb": f"{r['nbytes'] / 1e6:.0f}", f"{k}_features_gbps": f"{r['features_gbps']:.2f}"})
        elif r["mode"] != "copy":
            fields.update({f"{k}_p99_over_median": f"{r['p99_e2e_ms'] / r['e2e_ms']:.2f}"})
            if r["mode"] == "view":
                fields.update({f"{k}_direct": f"{r['direct']}/{repeats}"})
        elif r["label"] in base:  # the same size without populate, measured just before in this run
            b0 = base[r["label"]]
            fields.update({f"base_{k}_median_gbps": f"{b0['median_gbps']:.2f}", f"base_{k}_p99_gbps": f"{b0['p99_gbps']:.2f}",
                           f"base_{k}_ratio": f"{b0['ratio']:.3f}", f"{k}_p99_over_median": f"{r['p99_e2e_ms'] / r['e2e_ms']:.2f}",
                           f"{k}_first_seal_ms": f"{r['first_seal_ms']:.0f}", f"base_{k}_first_seal_ms": f"{b0['first_seal_ms']:.0f}",
                           f"base_{k}_p99_over_median": f"{b0['p99_e2e_ms'] / b0['e2e_ms']:.2f}"})
    print_result({"prefault": args.prefault, "populate": args.populate, "threads": args.threads, **fields})
    return 0
