"""`python -m app.bench data --records N`: the data path at scale, measured side by side in one run.

Synthetic chat records (half JSONL, half Parquet; 1-2 user/assistant exchanges of 4-150 words) through
the tiny target's word-level tokenizer and ChatML template, then:
- single_rec_s: records/s of the single-process tokenizer (the reference path; `tokenize_s` is its time);
- parallel_rec_s: records/s of the Ray Data pipeline with --workers workers (default: this machine's
  cores) on a local cluster already started, pipeline start-up included; the two datasets must be equal
  array for array and summary for summary, or the bench fails;
- cache_load_s: a second `load_or_tokenize` with the same inputs: cache key (stat of the inputs, hash
  of the tokenizer files) and the memory-mapped load, plus reading the offsets;
- driver_peak_mb: peak RSS of a fresh process doing what the driver does with that data: load the
  cache, build --epochs epochs of compact schedule and give each its drafter costs (what the supervisor
  `ray.put`s for the pool); for contrast it also prints what a list of every JobSpec costs;
- pool_bytes_per_job: Python heap the pool policy (`HSPool`) holds per queued job after `add_epoch` of
  every epoch, as the supervisor feeds it (tracemalloc), and the ledger's bytes per acked job;
- schedule_bytes_per_job: the epochs' compact arrays (`EpochJobs` with costs) per job. In a run they sit
  once in the object store of the driver's node and reach the pool zero-copy (read-only views), so they
  are not pool heap; the bench builds them before tracing and counts them here, separately.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from app.bench.common import own_cluster, print_result


def write_records(out: Path, n: int, seed: int = 0) -> list[str]:
    """n synthetic conversations: the first half as JSONL, the rest as Parquet (row groups of 4096)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from app.tiny.build import synthetic_words

    words = np.asarray(synthetic_words(400))
    rng = np.random.default_rng(seed)

    def text(k: int) -> str:
        return " ".join(words[rng.integers(0, len(words), k)].tolist())

    recs = []
    for _ in range(n):
        turns = []
        for _ in range(int(rng.integers(1, 3))):
            turns.append({"role": "user", "content": text(int(rng.integers(4, 24)))})
            turns.append({"role": "assistant", "content": text(int(rng.integers(8, 150)))})
        recs.append({"messages": turns})
    half = n // 2
    jsonl, parquet = out / "records.jsonl", out / "records.parquet"
    with open(jsonl, "w") as f:
        for r in recs[:half]:
            f.write(json.dumps(r) + "\n")
    pq.write_table(pa.Table.from_pylist(recs[half:]), parquet, row_group_size=4096)
    return [str(jsonl), str(parquet)]


def tokenizer_dir(out: Path) -> str:
    from app.tiny.build import build_tokenizer

    path = out / "tokenizer"
    build_tokenizer(512).save_pretrained(path)
    return str(path)


def records_config(files: list[str], out: Path):
    """The config the data path runs under: the tiny target's tokenizer, wider buckets, bad records skipped."""
    from app.config.drafter_sections import DrafterConfig
    from app.config.run_sections import CheckpointConfig
    from app.config.schema import Config, DataConfig, ModelConfig

    data = replace(DataConfig(), train_files=files, max_length=512, bucket_boundaries=[64, 128, 192, 256, 384, 512],
                   tokens_per_job=4096, on_error="skip")
    return Config(model=ModelConfig(target="tiny"), data=data, drafter=replace(DrafterConfig(), block_size=8),
                  checkpoint=CheckpointConfig(dir=str(out / "run")))


def same(a, b) -> bool:
    return (np.array_equal(a.tokens, b.tokens) and np.array_equal(a.loss_mask, b.loss_mask)
            and np.array_equal(a.offsets, b.offsets) and a.summary.to_dict() == b.summary.to_dict())


def driver_child(cfg_json: str, model_dir: str, epochs: int, as_list: bool) -> None:
    """In a fresh process: load the cached data and schedule every epoch as the driver does; print peak RSS."""
    from transformers import AutoTokenizer

    from app.data.costs import sequence_rows
    from app.data.pipeline import load_or_tokenize
    from app.data.schedule import ScheduledJobs, epoch_jobs

    cfg = _cfg_from_json(cfg_json)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ds = load_or_tokenize(cfg, model_dir, tok, list(cfg.data.train_files), progress=False, log=lambda _: None)
    lengths = ds.lengths()
    jobs = ScheduledJobs([epoch_jobs(lengths, cfg.data, e) for e in range(epochs)], est_bytes_per_token=1000)
    rows = sequence_rows(ds.loss_mask, ds.offsets, cfg.drafter.block_size, cfg.drafter.num_anchors)  # both ways
    if as_list:
        held = list(jobs)  # the old way: every JobSpec of every epoch at once
        count = len(held)
    else:  # the supervisor: each epoch with its drafter costs, put in the object store for the pool
        held = [e.with_costs(rows) for e in jobs.epochs]
        count = sum(len(e) for e in held)
    print(json.dumps({"peak_mb": peak_rss_mb(), "jobs": count, "schedule_bytes": jobs.nbytes}))


def peak_rss_mb() -> float:
    """This process's peak RSS: VmHWM (ru_maxrss on Linux keeps the forking parent's peak across exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cfg_from_json(blob: str):
    from app.config.drafter_sections import DrafterConfig
    from app.config.run_sections import CheckpointConfig
    from app.config.schema import Config, DataConfig, ModelConfig

    d = json.loads(blob)
    return Config(model=ModelConfig(target="tiny"), data=replace(DataConfig(), **d["data"]),
                  drafter=replace(DrafterConfig(), **d["drafter"]), checkpoint=CheckpointConfig(**d["checkpoint"]))


def measure_driver(cfg, model_dir: str, epochs: int, as_list: bool) -> dict:
    from dataclasses import asdict

    blob = json.dumps({"data": asdict(cfg.data), "drafter": asdict(cfg.drafter), "checkpoint": asdict(cfg.checkpoint)})
    code = ("import sys; from app.bench.runs.data import driver_child; "
            "driver_child(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == '1')")
    proc = subprocess.run([sys.executable, "-c", code, blob, model_dir, str(epochs), "1" if as_list else "0"],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_pool(cfg, dataset, epochs: int, bytes_per_token: int = 1000) -> dict:
    """Bytes per job of the pool policy, by tracemalloc: `queued` (pool heap per queued job after
    `add_epoch` of every epoch, as the supervisor feeds it), `acked` (the ledger per acked job) and
    `schedule` (the epochs' compact arrays: object-store bytes in a run, counted apart), and `jobs`."""
    import tracemalloc

    from app.config.schema import PoolConfig
    from app.data.costs import sequence_rows
    from app.data.schedule import epoch_jobs
    from app.messages import make_job_id
    from app.pool.book import Ledger
    from app.pool.hs_pool import HSPool

    rows = sequence_rows(dataset.loss_mask, dataset.offsets, cfg.drafter.block_size, cfg.drafter.num_anchors)
    lengths = dataset.lengths()
    # What the supervisor ray.puts; built before tracing, as in a run they are not the pool's allocations.
    schedule = [epoch_jobs(lengths, cfg.data, e).with_costs(rows) for e in range(epochs)]
    jobs = sum(len(e) for e in schedule)
    pool = HSPool(PoolConfig(), len(cfg.data.bucket_boundaries))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    queued_jobs = sum(pool.add_epoch(e, bytes_per_token) for e in schedule)
    queued = tracemalloc.get_traced_memory()[0] - before
    assert queued_jobs == jobs
    ledger = Ledger()
    before = tracemalloc.get_traced_memory()[0]
    for e in schedule:
        for k in range(len(e)):
            ledger.add(make_job_id(e.epoch, k))
    acked = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return {"queued": queued / jobs, "acked": acked / jobs, "schedule": sum(e.nbytes for e in schedule) / jobs,
            "jobs": jobs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.bench data", description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--epochs", type=int, default=6, help="epochs scheduled for the driver and pool figures")
    parser.add_argument("--keep", default="", help="folder to keep the inputs and the cache in (default: temp)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import ray
    from transformers import AutoTokenizer

    from app.data import cache
    from app.data.pipeline import data_cache_key, load_or_tokenize, tokenize_files

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.keep or tmp)
        out.mkdir(parents=True, exist_ok=True)
        files = write_records(out, args.records)
        model_dir = tokenizer_dir(out)
        tok = AutoTokenizer.from_pretrained(model_dir)
        cfg = records_config(files, out)
        load1 = os.getloadavg()[0]

        t0 = time.perf_counter()
        single = tokenize_files(cfg.data, cfg.drafter.block_size, model_dir, tok, files, workers=1)
        tokenize_s = time.perf_counter() - t0

        own_cluster(os.cpu_count())  # never another cluster on the machine; token auth
        t0 = time.perf_counter()
        parallel = tokenize_files(cfg.data, cfg.drafter.block_size, model_dir, tok, files, workers=args.workers)
        parallel_s = time.perf_counter() - t0
        ray.shutdown()
        if not same(single, parallel):
            print("FAIL: the Ray Data pipeline's dataset differs from the single-process one", file=sys.stderr)
            return 1

        key, parts = data_cache_key(cfg, model_dir, tok, files)  # the entry load_or_tokenize looks for
        cache.save(cache.cache_root(cfg), key, single, parts)  # what the first run's load_or_tokenize writes
        t0 = time.perf_counter()
        cached = load_or_tokenize(cfg, model_dir, tok, files, progress=False, log=print)
        int(cached.offsets[-1])  # touch the map
        cache_load_s = time.perf_counter() - t0
        assert same(single, cached)

        driver = measure_driver(cfg, model_dir, args.epochs, as_list=False)
        as_list = measure_driver(cfg, model_dir, args.epochs, as_list=True)
        pool = measure_pool(cfg, single, args.epochs)
        per_queued, per_acked, jobs = pool["queued"], pool["acked"], pool["jobs"]
        load2 = os.getloadavg()[0]

    n = args.records
    print(f"{n} records, {len(single)} kept sequences, {int(single.offsets[-1])} tokens; {jobs} jobs over "
          f"{args.epochs} epochs; compact schedule {driver['schedule_bytes'] / jobs:.1f} bytes/job")
    print(f"driver peak RSS: {driver['peak_mb']:.0f} MB with the compact schedule vs {as_list['peak_mb']:.0f} MB "
          f"holding every JobSpec; pool: {per_queued:.1f} bytes of heap per queued job (+ {pool['schedule']:.1f} "
          f"bytes per job of schedule arrays, shared in the object store once per node), ledger {per_acked:.1f} "
          f"bytes per acked job; load average {load1:.1f} at start, {load2:.1f} at end on {os.cpu_count()} cores")
    print_result({"single_rec_s": f"{n / tokenize_s:.0f}", "parallel_rec_s": f"{n / parallel_s:.0f}",
                  "speedup": f"{tokenize_s / parallel_s:.2f}", "cache_load_s": cache_load_s, "tokenize_s": f"{tokenize_s:.1f}",
                  "pool_bytes_per_job": f"{per_queued:.1f}", "schedule_bytes_per_job": f"{pool['schedule']:.1f}",
                  "driver_peak_mb": f"{driver['peak_mb']:.0f}"})
    return 0
