"""Benchmark dispatcher: `python -m app.bench pool|sched|e2e|loss|data|... [args...]`.

Each bench prints ratios measured side by side in one run and ends with one `RESULT key=value ...`
line. The modules are imported lazily so one bench's dependencies never slow another down.
"""
from __future__ import annotations

import importlib
import sys

BENCHES = {
    "pool": ("app.bench.feeding.pool_vs_queue", "put+pull pairs/s: pool actor vs ray.util.queue.Queue (refs, batch calls)"),
    "sched": ("app.bench.feeding.sched", "stratified vs round-robin vs random pulls vs per-drafter queues (step mix, backlog, busy)"),
    "e2e": ("app.bench.runs.e2e", "end-to-end training throughput"),
    "loss": ("app.bench.compute.loss", "DFlash loss kernels"),
    "sampled_step": ("app.bench.compute.sampled_step", "a drafter step at SmolLM2's shapes: full LM head vs sampled softmax"),
    "flops": ("app.bench.compute.flops", "target/drafter executed vs needed FLOPs and target peak memory at default shapes"),
    "memory": ("app.bench.compute.memory", "drafter peak GPU memory per bucket (fake tensors, full width): now vs before"),
    "data": ("app.bench.runs.data", "tokenizing at scale: single process vs Ray Data, cache load, driver RSS, pool bytes/job"),
    "chaos": ("app.bench.runs.chaos", "a run of the given config under outside faults: kills, SIGTERM, pool loss; counts every job"),
    "transport": ("app.bench.transport.object_store", "one job's features target -> pool -> drafter staging at 64/160/640 MiB vs memcpy"),
    "transport_nixl": ("app.bench.transport.nixl", "the same path with pool.transport=nixl beside object_store, same run"),
    "gpu": ("app.bench.compute.gpu", "one CUDA GPU: target prefill and drafter step tok/s, MFU, copy overlap, peak memory"),
    "rebalance": ("app.bench.feeding.rebalance", "topology.rebalance auto vs off, one side made short by injected delays: jobs per virtual s"),
    "replay": ("app.bench.transport.replay", "a job's features: target forward vs replay store write and read, tiny and SmolLM2 shapes"),
    "quality": ("app.bench.runs.quality", "tau per tiny corpus over 3 seeds beside n-gram and untrained drafters, copy shares"),
    "health": ("app.bench.runs.health", "an evaluation with the drafter's learning checks vs without, side by side (tiny demo)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHES:
        names = "\n".join(f"  {k:6s} {desc}" for k, (_, desc) in BENCHES.items())
        print(f"usage: python -m app.bench NAME [args...]\n{names}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHES[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
