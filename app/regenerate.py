"""`python -m app.regenerate --config FILE --in IN --out OUT`: responses rewritten by the target.

DFlash drafters learn best from the target's own outputs. This reads a chat dataset (JSONL/Parquet,
OpenAI or ShareGPT), and for every record regenerates each assistant turn greedily with the target,
turn by turn (later turns see the regenerated earlier ones); a conversation that ends with a user
turn gets one generated assistant turn appended. Work is spread over `topology.num_targets`
generator actors (actors/generator.py), in chunks of records with similar lengths.

OUT is JSONL, one `{"id": <line of the record in IN>, "messages": [...]}` per record, in completion
order. Resumable: ids already in OUT are skipped, and a torn last line (a crash mid-write) is cut off;
a complete line that is not a record is skipped and counted (`out_bad_lines`), never truncated at. OUT is
locked while a run writes it: a second run on the same OUT stops with one line, exit 2.
Each turn is capped so prompt + response stays within `data.max_length`.

Each chunk has a deadline (`--chunk-timeout-s`, from when it starts on its actor; the first chunk's
includes the model load): a wedged or dead generator is killed and restarted and its chunks go to
another actor (app/data/regen_dispatch.py); a chunk that fails three times is given up (counted in
`given_up`, left out of OUT for the next run to retry).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from app.config.schema import Config
from app.data.progress import progress_bar
from app.data.regen_dispatch import ChunkDispatcher, Restart
from app.data.regenerate import chunk_by_length, locked_out, pending_records, scan_out

CHUNK_TIMEOUT_S = 1800.0  # a chunk of 32 conversations on one CPU thread takes minutes, not half an hour


# ----------------------------------------------------------------------------------- driver


def run_regenerate(cfg: Config, in_path: str, out_path: str, *, max_new_tokens: int, chunk_size: int = 32,
                   batch_size: int = 16, progress: bool = True, chunk_timeout_s: float = CHUNK_TIMEOUT_S) -> dict:
    """Regenerate IN into OUT with `topology.num_targets` generator actors; returns the counts."""
    if not chunk_timeout_s > 0:
        from app.config.errors import ConfigError

        raise ConfigError(f"--chunk-timeout-s={chunk_timeout_s:g} must be positive: the seconds a chunk may take "
                          f"(default {CHUNK_TIMEOUT_S:g})")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with locked_out(out) as f:  # before reading it: a second writer must not see (or cut) our lines
        scan = scan_out(out)
        todo, counts = pending_records(in_path, cfg.data.format, cfg.data.on_error, set(scan.ids))
        counts |= {"out_bad_lines": scan.bad_lines, "written": 0, "given_up": 0}
        if todo:
            _generate(cfg, todo, f, counts, max_new_tokens, chunk_size, batch_size, progress, chunk_timeout_s)
    return counts


def _generate(cfg: Config, todo: list, f, counts: dict, max_new_tokens: int, chunk_size: int, batch_size: int,
              progress: bool, chunk_timeout_s: float) -> None:
    """Regenerate `todo` over the generator actors, appending each finished chunk to `f` (OUT); a chunk
    past its deadline, or on a dead actor, goes to another actor and its actor is restarted."""
    import ray
    from ray.exceptions import RayActorError

    from actors.generator import Generator
    from app.tiny.build import resolve_target
    from app.run.topology import uses_gpu

    if not ray.is_initialized():  # RAY_ADDRESS, or a throwaway local cluster with token auth (as app.train's)
        from app.ray_cluster import init_ray

        init_ray()
    topo = cfg.topology
    use_gpu = uses_gpu(topo, ray.cluster_resources().get("GPU", 0))
    model_dir = resolve_target(cfg).model_dir
    actor_cls = ray.remote(Generator).options(num_cpus=topo.cpus_per_target,
                                               num_gpus=topo.gpus_per_target if use_gpu else 0)

    def start():
        return actor_cls.remote(model_dir, cfg.model.dtype, topo.device if use_gpu else "cpu", topo.cpus_per_target)

    actors = [start() for _ in range(topo.num_targets)]
    chunks = chunk_by_length(todo, chunk_size)
    gen_args = dict(max_new_tokens=max_new_tokens, max_length=cfg.data.max_length, batch_size=batch_size,
                    enable_thinking=cfg.data.enable_thinking)
    disp = ChunkDispatcher(len(chunks), len(actors), chunk_timeout_s)
    in_flight: dict = {}  # ref -> Assign

    def restart(r: Restart) -> None:
        ray.kill(actors[r.slot])
        actors[r.slot] = start()
        for ref in [ref for ref, a in in_flight.items() if a.slot == r.slot]:
            del in_flight[ref]
        counts["given_up"] += sum(len(chunks[c]) for c in r.given_up)
        print(f"regenerate: generator {r.slot} restarted ({r.reason}); {len(r.chunks) - len(r.given_up)} chunk(s) "
              f"queued again, {len(r.given_up)} given up", file=sys.stderr)

    try:
        with progress_bar(len(todo), "regenerate", enabled=progress) as bar:
            while not disp.finished:
                for a in disp.assignments():
                    in_flight[actors[a.slot].regenerate.remote(chunks[a.chunk], **gen_args)] = a
                ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=disp.wait_s() + 1.0)
                for ref in ready:
                    if (a := in_flight.pop(ref, None)) is None:
                        continue  # its actor was restarted meanwhile
                    try:
                        done = ray.get(ref)
                    except RayActorError:
                        restart(disp.failed(a.slot))
                        continue
                    for rec_id, messages in done:
                        f.write(json.dumps({"id": rec_id, "messages": messages}) + "\n")
                        counts["written"] += 1
                    f.flush()
                    os.fsync(f.fileno())
                    disp.done(a.slot, a.chunk)
                    bar.update(len(done))
                for r in disp.overdue():
                    restart(r)
    finally:
        for a in actors:
            ray.kill(a)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.regenerate", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML file, e.g. conf/default.yaml")
    parser.add_argument("--in", dest="in_path", required=True, help="chat dataset (JSONL/Parquet, openai or sharegpt)")
    parser.add_argument("--out", required=True, help="JSONL to write (appended to; records already there are skipped)")
    parser.add_argument("--max-new-tokens", type=int, default=0, help="per turn; 0 = up to data.max_length")
    parser.add_argument("--chunk-size", type=int, default=32, help="records per actor task")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences generated together")
    parser.add_argument("--chunk-timeout-s", type=float, default=CHUNK_TIMEOUT_S,
                        help="seconds a chunk may take on its actor before the actor is restarted and the chunk "
                             "goes to another")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)

    from app.config.errors import UserError
    from app.config.load import load_config

    t0 = time.perf_counter()
    try:
        cfg = load_config(args.config, args.overrides)
        counts = run_regenerate(cfg, args.in_path, args.out,
                                max_new_tokens=args.max_new_tokens or cfg.data.max_length,
                                chunk_size=args.chunk_size, batch_size=args.batch_size,
                                chunk_timeout_s=args.chunk_timeout_s)
    except UserError as exc:  # ConfigError, DataError: one line, exit 2
        print(f"{exc.kind} error: {exc}", file=sys.stderr)
        return 2
    print(" ".join(f"{k}={v}" for k, v in counts.items()) + f" -> {args.out} ({time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
