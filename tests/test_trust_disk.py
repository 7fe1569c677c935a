"""Issue 22, item 17: what a long URI run costs on local disk, in memory and in the object store.

(a) the local disk a URI run uses is bounded (one copy of an export however often it is loaded, the
newest checkpoint versions only, a SIGKILLed stager's folder removed on the next start); (b) the timeline
is read as a stream; (c) the object-store check counts eval offers and the dataset; (d) transient
object-store errors are retried; (e) a URI save and load stream in chunks.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch) -> Path:
    """Every cache, staging and download folder under tmp_path (a fresh `<tmp>/dflash-<uid>/`)."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # the SIGKILLed subprocess stages there too
    from app.storage.local_cache import cache_root

    return cache_root()


def _copies(root: Path, name: str) -> int:
    return sum(1 for _ in root.rglob(name))


# ---- (a) temp disk ------------------------------------------------------------------------------------

def _tiny_drafter(seed: int, layers: int = 1):
    from app.model.drafter import DFlashDrafter
    from tests.toy import tiny_arch, tiny_qwen3_config

    torch.manual_seed(seed)
    arch = tiny_arch(tiny_qwen3_config(), num_layers=layers, block_size=4, target_layer_ids=(0, 2), mask_token_id=7)
    return DFlashDrafter(arch).eval(), arch


def _upload_export(tmp_path: Path, uri: str, seed: int, layers: int = 1) -> dict:
    """Export a drafter and upload it to `<uri>/drafter` as the driver does (in place, config.json last)."""
    from app.model.export import export_drafter
    from app.storage.roots import open_storage

    drafter, arch = _tiny_drafter(seed, layers)
    local = export_drafter(drafter, arch, tmp_path / f"export-{seed}")
    open_storage(uri).upload_dir(local, "drafter", last="config.json")
    return {k: v.clone() for k, v in drafter.state_dict().items()}


def test_loading_a_uri_export_again_reuses_its_one_copy(s3, tmp_path: Path, private_tmp: Path) -> None:
    """(a) `load_drafter` on a URI copied the whole export into a fresh folder on every call, never
    removed (three loads: three copies). Now one copy, reused while the remote files are unchanged and
    replaced when the export is rewritten (the weights loaded are the new ones, still one copy). The copy
    is checked against the remote listing (keys, sizes, mtimes); S3 keeps mtimes in whole seconds, so the
    rewrite here is one of another size, as a same-size one within the same second would look unchanged."""
    from app.model.export import load_drafter
    from app.storage.roots import open_storage

    uri = s3.uri("export-reuse")
    first = _upload_export(tmp_path, uri, seed=1)
    for _ in range(3):
        drafter, _ = load_drafter(open_storage(uri).location("drafter"))
    assert _copies(private_tmp, "model.safetensors") == 1
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in first.items())

    second = _upload_export(tmp_path, uri, seed=2, layers=2)
    drafter, _ = load_drafter(open_storage(uri).location("drafter"))
    assert len(second) > len(first)
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in second.items())
    assert _copies(private_tmp, "model.safetensors") == 1


def test_only_the_newest_checkpoint_versions_stay_cached(s3, private_tmp: Path) -> None:
    """(a) every checkpoint version a node loaded stayed in its cache (five resumes: five copies of the
    weights and optimizer). Now at most KEEP_VERSIONS per run root, the newest loaded ones, and a
    checkpoint loaded twice is downloaded once."""
    from app.storage.local_cache import KEEP_VERSIONS
    from app.training.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint

    uri = s3.uri("versions")
    for step in range(1, 6):
        save_checkpoint(uri, TrainState(step=step, epoch=0, ledger=[step], drafter={"w": torch.full((4,), step)}),
                        keep=10)
        state = load_checkpoint(latest_checkpoint(uri))
        assert state.step == step and torch.equal(state.drafter["w"], torch.full((4,), step))
    assert KEEP_VERSIONS == 2 and _copies(private_tmp, "drafter.safetensors") == KEEP_VERSIONS
    before = sorted(p.stat().st_ino for p in private_tmp.rglob("drafter.safetensors"))
    assert load_checkpoint(latest_checkpoint(uri)).step == 5
    assert sorted(p.stat().st_ino for p in private_tmp.rglob("drafter.safetensors")) == before  # reused


def test_a_sigkilled_stager_s_folder_is_removed_on_the_next_start(tmp_path: Path, private_tmp: Path) -> None:
    """(a) a process killed mid-save (SIGKILL: no finally runs) left its staging folder in the cache
    forever (the export's upload folder too, in /tmp). The next process that stages or downloads removes
    them; a live process's staging, a planted symlink's target and other folders stay."""
    from app.storage import local_cache

    uri = f"file://{tmp_path / 'bucket' / 'run'}"
    code = ("import os, signal; from app.storage.roots import open_storage\n"
            f"store = open_storage({uri!r})\n"
            "p = store.stage('ckpt-00000007'); (p / 'drafter.safetensors').write_bytes(b'x' * 1000); print(p)\n"
            "with store.scratch('drafter') as q:  # the export's folder before its upload\n"
            "    (q / 'model.safetensors').write_bytes(b'x' * 1000); print(q, flush=True); os.kill(os.getpid(), 9)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=os.environ)
    assert out.returncode == -9, out.stderr
    left = [Path(line) for line in out.stdout.split()]
    assert len(left) == 2 and all(p.parent == private_tmp and p.is_dir() for p in left)  # what the kill left behind

    mine = local_cache.owned_tmp("stage-ckpt-00000008-", private_tmp)  # this (live) process's staging
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (private_tmp / f"stage-x-1@{__import__('socket').gethostname()}-abcdefgh").symlink_to(outside)
    (private_tmp / "run-0123456789ab").mkdir()  # a run's own cache folder
    removed = local_cache.clean_stale(private_tmp)
    assert all(p.name in removed and not p.exists() for p in left)
    assert mine.is_dir() and (outside / "keep.txt").read_text() == "keep"
    assert (private_tmp / "run-0123456789ab").is_dir()
    assert not any(p.is_symlink() for p in private_tmp.iterdir())


def test_staging_of_an_owner_in_another_pid_namespace_is_judged_by_its_age(private_tmp: Path, monkeypatch) -> None:
    """Two containers with one hostname share a TMPDIR; container A's names carry a pid that only A's pid
    namespace can judge. Container B's start-up cleanup judged them by B's pids: A's save in flight (a pid B
    does not see) was deleted under it, and a dead A's folder named by A's pid 1 (alive in B: B's own init)
    stayed forever. Now each name carries its boot and pid namespace (app/storage/owner.py): B keeps A's
    folder until it is untouched for FOREIGN_STALE_S, and still removes a dead pid's folder of its own
    namespace at once. Before: A's live staging removed, A's dead one kept."""
    import time

    from app.storage import local_cache
    from tests.test_trust_lease_release import _dead_pid

    dead, real_readlink = _dead_pid(), os.readlink
    with monkeypatch.context() as container_a:
        container_a.setattr(os, "readlink", lambda path, *a, **k: "pid:[4026530001]" if str(path) == "/proc/self/ns/pid"
                            else real_readlink(path, *a, **k))
        container_a.setattr(os, "getpid", lambda: dead)  # a pid B does not see: A's live rank
        live = local_cache.owned_tmp("stage-ckpt-00000008-", private_tmp)
        container_a.setattr(os, "getpid", lambda: 1)  # A's pid 1, gone with its container
        dead_a = local_cache.owned_tmp(".fetch-", private_tmp)
    with monkeypatch.context() as container_b:
        container_b.setattr(os, "getpid", lambda: dead)
        dead_b = local_cache.owned_tmp("stage-ckpt-00000009-", private_tmp)  # this namespace's dead process
    old = time.time() - 4 * 24 * 3600  # untouched for four days (FOREIGN_STALE_S: three)
    os.utime(dead_a, (old, old))
    removed = local_cache.clean_stale(private_tmp)
    assert live.is_dir() and live.name not in removed
    assert sorted(removed) == sorted([dead_a.name, dead_b.name]) and not dead_a.exists() and not dead_b.exists()
    assert local_cache.FOREIGN_STALE_S == 3 * 24 * 3600


# ---- (e) a URI save and load stream --------------------------------------------------------------------

def test_a_uri_save_and_load_stream_in_chunks(tmp_path: Path, private_tmp: Path) -> None:
    """(e) publishing a staged checkpoint read each file whole into memory (a 64 MiB file: a 64 MiB
    peak; a real one is several GB), and so did its download. Both now hold one CHUNK at a time: the
    Python heap's peak stays under 1.5 chunks, a fifth of the file, and the bytes arrive intact."""
    import hashlib
    import tracemalloc

    from app.storage.fetch import fetch_dir
    from app.storage.roots import open_storage
    from app.storage.uri_storage import CHUNK

    size = 64 << 20
    store = open_storage(f"file://{tmp_path / 'bucket' / 'run'}")
    staged = store.stage("ckpt-00000001")
    with open(staged / "drafter.safetensors", "wb") as f:
        f.truncate(size)  # sparse: no time spent writing it
        f.seek(size // 2)
        f.write(b"the middle")
    digest = hashlib.sha256((staged / "drafter.safetensors").read_bytes()).hexdigest()

    tracemalloc.start()
    try:
        location = store.publish(staged, "ckpt-00000001")
        _, save_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        local = fetch_dir(location)
        _, load_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 1.5 * CHUNK < size / 5
    assert save_peak < 1.5 * CHUNK and load_peak < 1.5 * CHUNK, (save_peak, load_peak)
    assert hashlib.sha256((local / "drafter.safetensors").read_bytes()).hexdigest() == digest


# ---- (b) the timeline is read as a stream -----------------------------------------------------------------

def _write_timeline(folder: Path, steps: int, ranks: int = 3, pool_every: int = 10, eval_every: int = 0) -> int:
    """A synthetic timeline as Timeline writes it: a run header, step rows of every rank, pool snapshots,
    events and evaluations. Returns its size in bytes."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "timeline.jsonl").open("w") as f:
        f.write(json.dumps({"k": "run", "t": 0.0, "num_targets": 2, "num_drafters": ranks, "resumed_step": 0}) + "\n")
        for step in range(1, steps + 1):
            for rank in range(ranks):
                row = {"k": "step", "t": step * 0.2, "rank": rank, "step": step, "epoch": 0, "loss": 5.0 / step,
                       "correct": 0.5, "tokens": 4096, "accept_len": 2.0, "compute_s": 0.15,
                       "topk_acc": 0.8 if rank == 0 and step % 1000 == 7 else -1,  # a sampling step
                       "data_wait_s": 0.05 * (rank + 1), "lr": 1e-4, "grad_norm": 1.0}
                if rank == 0:
                    row["per_pos_acc"] = [0.9, 0.7, 0.5]
                f.write(json.dumps(row) + "\n")
            if step % pool_every == 0:
                f.write(json.dumps({"k": "pool", "t": step * 0.2, "q_hsb": [1, 2], "capacity_items": 16,
                                    "forward_s_by_target": {"0": step * 0.1, "1": step * 0.1}}) + "\n")
            if eval_every and step % eval_every == 0:
                f.write(json.dumps({"k": "eval", "t": step * 0.2, "step": step, "tau": 1.0 + step / steps,
                                    "per_pos_accept": [0.8, 0.4]}) + "\n")
        f.write(json.dumps({"k": "event", "t": steps * 0.2, "text": "target 1 died"}) + "\n")
        f.write('{"k": "step", "t": 1')  # a killed driver's torn last line
    return (folder / "timeline.jsonl").stat().st_size


def test_the_readers_of_a_small_timeline_see_what_the_whole_file_holds(tmp_path: Path) -> None:
    """(b) below the report's caps the streamed readers keep every row, in file order: the same rows
    the whole-file read gave."""
    from app.run.outputs.timeline import iter_timeline, read_timeline, report_rows

    _write_timeline(tmp_path, steps=50, eval_every=10)
    whole = read_timeline(tmp_path)
    assert len(whole) == 1 + 150 + 5 + 5 + 1
    assert report_rows(tmp_path) == whole
    assert list(iter_timeline(tmp_path, kinds=("eval",))) == [r for r in whole if r["k"] == "eval"]


def test_a_long_timeline_is_read_in_bounded_memory(tmp_path: Path) -> None:
    """(b) every resume and every report read the whole timeline into a list of dicts (about 2.9 GiB of
    RSS per day of run). Now: opening it for appending reads one byte; the resume's evaluations and the
    report's rows are read as a stream, the report keeping at most its caps of step rows (per rank, evenly
    spaced, compute and wait summed over the rows each stands for) and pool snapshots. The Python heap's
    peak stays under an eighth of the file (a day's file is ~0.5 GiB: the peak stays what the caps hold)."""
    import tracemalloc

    from app.run.outputs.timeline import Timeline, iter_timeline, report_rows

    size = _write_timeline(tmp_path, steps=4_000, eval_every=1_000)  # 12k step rows, ~3 MB
    tracemalloc.start()
    try:
        Timeline(tmp_path).close()
        _, open_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        evals = list(iter_timeline(tmp_path, kinds=("eval",)))
        _, resume_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        rows = report_rows(tmp_path, step_rows=150, pool_rows=50, min_rank_rows=40)
        _, report_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [e["step"] for e in evals] == [1000, 2000, 3000, 4000]
    assert max(open_peak, resume_peak, report_peak) < size / 8, (open_peak, resume_peak, report_peak, size)

    steps = [r for r in rows if r["k"] == "step"]
    by_rank = {rank: [r for r in steps if r["rank"] == rank] for rank in range(3)}
    assert all(25 <= len(mine) <= 50 for mine in by_rank.values())  # 150 over 3 ranks, evenly thinned
    series = [r for r in by_rank[0] if r["compute_s"] > 0]  # without the sampling steps kept beside it
    gaps = {b["step"] - a["step"] for a, b in zip(series, series[1:])}
    assert len(gaps) == 1  # evenly spaced
    # each kept row stands for `gap` steps: its summed compute and wait give rank 2's true share (0.15 / 0.3)
    gap = next(iter({b["step"] - a["step"] for a, b in zip(by_rank[2], by_rank[2][1:])}))
    assert all(abs(r["compute_s"] - 0.15 * gap) < 1e-6 for r in by_rank[2][:-1])
    assert all(abs(r["compute_s"] / (r["compute_s"] + r["data_wait_s"]) - 0.5) < 1e-9 for r in by_rank[2])
    assert [r["step"] for r in steps if r["topk_acc"] >= 0] == [7, 1007, 2007, 3007]  # none thinned away
    pools = [r for r in rows if r["k"] == "pool"]
    assert 25 <= len(pools) <= 50
    assert [r["k"] for r in rows if r["k"] not in ("step", "pool")] == ["run", *["eval"] * 4, "event"]
    assert [r.get("t") for r in rows] == sorted(r.get("t") for r in rows)  # file order kept


# ---- (c) the object-store check counts eval offers and the dataset ----------------------------------------

def test_the_object_store_check_counts_eval_offers_and_the_dataset() -> None:
    """(c) the check compared the pool's payload bound alone with the object store: a pool that fit
    with 0.5 GiB to spare passed although the dataset (put once for the targets) and three float32
    copies of the drafter's weights (live evaluations) sit in the same store and spill it. Now they
    count, and the one line names them."""
    from app.config.errors import ConfigError
    from app.pool.holdings import check_object_store
    from app.config.drafter_sections import TrainConfig
    from app.config.schema import Config, PoolConfig, TopologyConfig
    from app.pool.holdings import EVAL_COPIES, eval_offer_bytes

    gib = 2**30
    cfg = Config(pool=PoolConfig(capacity=24, capacity_bytes=15 * gib + gib // 2, min_ready=1),
                 topology=TopologyConfig(num_drafters=3), train=TrainConfig(grad_accum=4))
    check_object_store(cfg, gib // 2, 16 * gib)  # the pool alone: 15.5 of 16 GiB
    check_object_store(cfg, gib // 2, 16 * gib, dataset_bytes=gib // 4)
    weights = gib // 2
    assert eval_offer_bytes(weights, evaluating=False) == 0
    with pytest.raises(ConfigError) as e:
        check_object_store(cfg, gib // 2, 16 * gib, dataset_bytes=gib // 4,
                           eval_bytes=eval_offer_bytes(weights, evaluating=True))
    msg = str(e.value)
    assert EVAL_COPIES == 3 and "\n" not in msg
    assert "15.5 GiB of hidden states" in msg and "0.2 GiB of the dataset" in msg and "1.5 GiB of eval offers" in msg


def test_the_eval_offer_size_is_the_drafter_s_float32_state_dict(tmp_path: Path) -> None:
    """(c) the eval offers are counted at the size rank 0 really puts: its float32 state dict
    (counted on the meta device, so the check costs no memory), and the dataset at its arrays' bytes."""
    from types import SimpleNamespace

    import numpy as np

    from app.config.drafter_sections import DrafterConfig
    from app.config.schema import DataConfig
    from app.data.schedule import ScheduledJobs, epoch_jobs
    from app.model.arch import DrafterArch
    from app.model.build import drafter_state_bytes
    from app.model.drafter import DFlashDrafter
    from app.model.drafter_tau import weights_to_numpy
    from app.pool.holdings import EVAL_COPIES
    from app.run.plan import object_store_extras
    from tests.toy import tiny_qwen3_config

    config = tiny_qwen3_config()
    config.save_pretrained(tmp_path)
    dcfg = DrafterConfig(num_layers=1, block_size=4)
    arch = DrafterArch.from_target(config, __import__("dataclasses").replace(dcfg, mask_token_id=7), [0, 2])
    real = sum(a.nbytes for a in weights_to_numpy(DFlashDrafter(arch)).values())
    assert drafter_state_bytes(str(tmp_path), dcfg, [0, 2], 7) == real

    data = SimpleNamespace(tokens=np.zeros(1000, np.int32), loss_mask=np.zeros(1000, np.uint8),
                           offsets=np.zeros(11, np.int64))
    jobs = ScheduledJobs([epoch_jobs(np.array([50, 60, 70]), DataConfig(), 0)])  # the real schedule type
    plan = SimpleNamespace(dataset=data, jobs=jobs, eval_prompts=[[1, 2]],
                           model_dir=str(tmp_path), layer_ids=[0, 2], mask_token_id=7,
                           cfg=SimpleNamespace(drafter=dcfg, eval=SimpleNamespace(every_steps=100)))
    assert jobs.nbytes > 0
    assert object_store_extras(plan) == (4000 + 1000 + 88 + jobs.nbytes, EVAL_COPIES * real)
    plan.cfg.eval.every_steps = 0
    assert object_store_extras(plan) == (5088 + jobs.nbytes, 0)


# ---- (d) transient object-store errors are retried --------------------------------------------------------

def test_transient_object_store_errors_are_retried_with_backoff() -> None:
    """(d) a full store, a timed-out fetch or a failed raylet call failed the payload fetch or the eval
    offer at once (a job recomputed as lost, a drafter death, an evaluation skipped). Now they are tried
    again with growing waits; a lost object and any other error are raised at once, and so is the last
    transient one when the attempts are spent."""
    from ray.exceptions import ObjectFetchTimedOutError, ObjectLostError, ObjectStoreFullError, RpcError

    from app.training.retry import Backoff, transient_object_errors, with_retries

    transient = transient_object_errors()
    ref = "ab" * 14
    failures = [ObjectStoreFullError("object store full"), ObjectFetchTimedOutError(ref, None, ""), RpcError("gone")]
    slept, told = [], []

    def flaky():
        if failures:
            raise failures.pop(0)
        return "payload"

    assert with_retries(flaky, transient, sleep=slept.append, on_retry=lambda n, e, w: told.append((n, type(e)))) \
        == "payload"
    assert slept == [0.5, 1.0, 2.0]
    assert told == [(1, ObjectStoreFullError), (2, ObjectFetchTimedOutError), (3, RpcError)]

    calls, slept = [], []

    def always_full():
        calls.append(1)
        raise ObjectStoreFullError("object store full")

    with pytest.raises(ObjectStoreFullError):
        with_retries(always_full, transient, Backoff(attempts=6, first_s=0.5, factor=2.0, max_s=4.0), sleep=slept.append)
    assert len(calls) == 6 and slept == [0.5, 1.0, 2.0, 4.0, 4.0]

    for permanent in (ObjectLostError(ref, None, ""), ValueError("a bug")):
        calls, slept = [], []

        def broken(err=permanent):
            calls.append(1)
            raise err

        with pytest.raises(type(permanent)):
            with_retries(broken, transient, sleep=slept.append)
        assert len(calls) == 1 and slept == []


def test_an_evaluation_s_weights_reach_the_target_as_a_ref_it_fetches_itself() -> None:
    """(d) Ray resolved rank 0's weight ref before the target's `evaluate_weights` ran, where no retry
    could reach a transient fetch error. The ref now travels inside a list (the target fetches it with
    retries); folders, state dicts and None pass as they were."""
    from types import SimpleNamespace

    import ray

    from app.run.evaluate.final_tau import ask_tau

    sent = []
    handle = SimpleNamespace(evaluate_weights=SimpleNamespace(remote=lambda *a: sent.append(a[1])))
    ref = ray.ObjectRef(b"\x01" * 28)
    for weights in (ref, "/runs/x/drafter", {"w": 1}, None):
        ask_tau(handle, 10, weights, spec=None)
    assert sent == [[ref], "/runs/x/drafter", {"w": 1}, None]
