"""The replay store (issue 38 part 2): entries checked on every read, write-once, the byte budget, a job's
batch assembled across epochs, and the TargetActor skipping its forward on a hit (its own counters)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from app.replay.backend import LocalFolder
from app.replay.entry import BadEntry, decode_entry, encode_entry
from app.replay.jobs import keep_job, replay_job
from app.replay.key import ReplayKey, sequence_name
from app.replay.store import ReplayStore

KEY = ReplayKey(weights="w" * 32, layers=(1, 3), payload_dtype="float32")


def _seq(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 100, n).astype(np.int32), np.ones(n, np.uint8)


def _rows(seed: int, n: int, d: int = 8) -> np.ndarray:
    return np.random.default_rng(1000 + seed).standard_normal((n, d)).astype(np.float32)


def _store(root: Path, key: ReplayKey = KEY, max_bytes: int = 1 << 30, log=None) -> ReplayStore:
    return ReplayStore(LocalFolder(root), key, max_bytes, log=log or (lambda _: None))


def _entry_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.feat"))


def test_an_entry_round_trips_and_any_corrupt_byte_is_refused() -> None:
    ids, _ = _seq(0, 5)
    rows = (np.arange(5 * 4, dtype=np.float32).reshape(5, 4) + 0.5).view(np.uint32).astype(np.uint16)
    scales = np.linspace(0.1, 0.5, 5, dtype=np.float32)
    data = encode_entry(sequence_name(ids), rows.astype(np.uint8), "float8_e4m3", scales)
    got, got_scales = decode_entry(data, sequence_name(ids), 5, "float8_e4m3")
    assert np.array_equal(got, rows.astype(np.uint8)) and np.array_equal(got_scales, scales)
    for at in (0, 20, len(data) - 1):  # magic, header, body
        bad = bytearray(data)
        bad[at] ^= 0x01
        with pytest.raises(BadEntry):
            decode_entry(bytes(bad), sequence_name(ids), 5, "float8_e4m3")
    with pytest.raises(BadEntry):  # truncated
        decode_entry(data[:-1], sequence_name(ids), 5, "float8_e4m3")
    with pytest.raises(BadEntry):  # another sequence's name, length or dtype
        decode_entry(data, sequence_name(ids[:4]), 5, "float8_e4m3")
    with pytest.raises(BadEntry):
        decode_entry(data, sequence_name(ids), 4, "float8_e4m3")
    with pytest.raises(BadEntry):
        decode_entry(data, sequence_name(ids), 5, "bfloat16")


def test_put_get_corrupt_wrong_key_and_a_second_writer(tmp_path: Path) -> None:
    store = _store(tmp_path)
    ids, _ = _seq(1, 7)
    assert store.get(ids) is None and store.stats.misses == 1
    assert store.put(ids, _rows(1, 7))
    assert np.array_equal(store.get(ids).rows, _rows(1, 7))
    # A second writer of the same entry (another target, another run) is refused; the first one's bytes stay.
    other = _store(tmp_path)
    assert not other.put(ids, _rows(2, 7)) and other.stats.refused == 1
    assert np.array_equal(other.get(ids).rows, _rows(1, 7))
    # Another key (layers, dtype or weights) is another folder: a miss, never these features.
    for key in (ReplayKey(KEY.weights, (1, 2), "float32"), ReplayKey(KEY.weights, (1, 3), "bfloat16"),
                ReplayKey("v" * 32, (1, 3), "float32")):
        assert _store(tmp_path, key).get(ids) is None
    # One flipped byte: the read refuses it, removes it, and a later write puts it back.
    (path,) = _entry_files(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10
    path.write_bytes(bytes(raw))
    assert store.get(ids) is None and store.stats.bad == 1 and not path.exists()
    assert store.put(ids, _rows(1, 7)) and np.array_equal(store.get(ids).rows, _rows(1, 7))


def test_a_manifest_of_another_key_turns_replay_off(tmp_path: Path) -> None:
    said: list[str] = []
    (tmp_path / KEY.folder).mkdir()
    (tmp_path / KEY.folder / "manifest.json").write_text('{"key": {"weights": "someone else"}}')
    store = _store(tmp_path, log=said.append)
    ids, _ = _seq(3, 4)
    assert not store.enabled and not store.put(ids, _rows(3, 4)) and store.get(ids) is None
    assert len(said) == 1 and "replay is off" in said[0]


def test_the_budget_stops_writing_and_says_so_once(tmp_path: Path) -> None:
    said: list[str] = []
    one = len(encode_entry(sequence_name(_seq(0, 10)[0]), _rows(0, 10), "float32"))
    _store(tmp_path)  # writes the manifest
    manifest = LocalFolder(tmp_path).used_bytes()
    store = _store(tmp_path, max_bytes=manifest + 3 * one + one // 2, log=said.append)
    written = [store.put(_seq(s, 10)[0], _rows(s, 10)) for s in range(6)]
    used = LocalFolder(tmp_path).used_bytes()
    assert written == [True] * 3 + [False] * 3 and store.stats.skipped_full == 3
    assert used == manifest + 3 * one <= store.max_bytes
    assert len(said) == 1 and "pool.replay_max_gb" in said[0]
    listings = []
    store.backend.used_bytes = lambda: listings.append(1) or used
    assert not store.put(_seq(7, 10)[0], _rows(7, 10)) and listings == []  # full for good: no listing per sequence
    # A later writer measures what is there: no room for more.
    assert not _store(tmp_path, max_bytes=store.max_bytes).put(_seq(9, 10)[0], _rows(9, 10))


def _batch_of(job_id: int, seqs: list, seeds: list[int]):
    """A forward's batch for `seqs`: padded, with garbage past each length (as padded SDPA leaves)."""
    from app.data.target_forward import pad_sequences
    from app.messages import HiddenBatch

    ids, mask, lengths = pad_sequences(seqs)
    hidden = np.full((len(seqs), ids.shape[1], 8), 7.0, np.float32)
    for r, (s, n) in enumerate(zip(seeds, lengths.tolist())):
        hidden[r, :n] = _rows(s, n)
    return HiddenBatch(job_id, hidden, "float32", ids, mask, lengths)


def test_a_job_is_assembled_from_sequences_another_job_wrote(tmp_path: Path) -> None:
    store = _store(tmp_path)
    seqs = {s: _seq(s, 3 + s) for s in range(5)}
    assert keep_job(store, _batch_of(1, [seqs[0], seqs[1], seqs[2]], [0, 1, 2])) == 3
    assert keep_job(store, _batch_of(2, [seqs[3]], [3])) == 1
    # The next epoch regroups: (3, 0) is all stored, (4, 1) is not: the whole job goes to the target.
    got = replay_job(store, 7, [seqs[3], seqs[0]])
    assert got is not None and got.job_id == 7 and got.hidden_dtype == "float32"
    assert got.lengths_B.tolist() == [6, 3] and np.array_equal(got.input_ids_BS[1, :3], seqs[0][0])
    assert np.array_equal(got.hidden_BSD[0, :6], _rows(3, 6)) and np.array_equal(got.hidden_BSD[1, :3], _rows(0, 3))
    assert not got.hidden_BSD[1, 3:].any()  # zeros past the length, as a packed forward leaves them
    assert replay_job(store, 8, [seqs[4], seqs[1]]) is None


def test_fp8_scales_travel_with_their_codes(tmp_path: Path) -> None:
    from app.data.target_forward import pad_sequences
    from app.messages import HiddenBatch

    store = _store(tmp_path, ReplayKey("w" * 32, (1,), "float8_e4m3"))
    seqs = [_seq(0, 4), _seq(1, 2)]
    ids, mask, lengths = pad_sequences(seqs)
    codes = np.random.default_rng(0).integers(0, 255, (2, 4, 8)).astype(np.uint8)
    scales = np.random.default_rng(1).random((2, 4)).astype(np.float32)
    keep_job(store, HiddenBatch(1, codes, "float8_e4m3", ids, mask, lengths, scales))
    got = replay_job(store, 2, seqs[::-1])
    assert np.array_equal(got.hidden_BSD[0, :2], codes[1, :2]) and np.array_equal(got.hidden_scale_BS[0, :2], scales[1, :2])
    assert np.array_equal(got.hidden_BSD[1], codes[0]) and np.array_equal(got.hidden_scale_BS[1], scales[0])


def _tiny_run(model_dir: Path, run_dir: Path, replay: str | None):
    """A TargetActor (in this process) over a 12-sequence dataset, and the jobs of two epochs."""
    from actors.target import TargetActor
    from app.config.run_sections import FaultsConfig
    from app.config.schema import DataConfig, ModelConfig
    from app.data.dataset import DataSummary, TokenizedDataset
    from app.data.schedule import epoch_jobs
    from app.replay.spec import ReplaySpec

    seqs = [_seq(s, 6 + (5 * s) % 11) for s in range(12)]
    offsets = np.concatenate([[0], np.cumsum([len(i) for i, _ in seqs])]).astype(np.int64)
    data = TokenizedDataset(np.concatenate([i for i, _ in seqs]), np.concatenate([m for _, m in seqs]), offsets,
                            DataSummary())
    cfg = DataConfig(max_length=32, bucket_boundaries=[32], tokens_per_job=48, seed=0)
    epochs = [epoch_jobs(data.lengths(), cfg, e).specs() for e in range(2)]
    spec = ReplaySpec(replay, 1 << 30) if replay else None
    target = TargetActor(0, str(model_dir), [1, 3], ModelConfig(target=str(model_dir), dtype="float32"), "cpu", 1,
                         data, FaultsConfig(), str(run_dir), replay=spec)
    return target, epochs


def test_the_target_forwards_epoch_one_and_replays_epoch_two(tiny_target, tmp_path: Path) -> None:
    """From the target's own counters: epoch 1's jobs are forwarded and written, epoch 2's (other groupings
    of the same sequences) are served from the store with no forward, with the features a forward gives;
    a corrupt entry sends its job back to the target."""
    from app.replay.target_side import read_counts

    _, model_dir = tiny_target
    target, (first, second) = _tiny_run(model_dir, tmp_path / "run", str(tmp_path / "replay"))
    assert {tuple(j.seq_indices) for j in first} != {tuple(j.seq_indices) for j in second}
    for job in first:
        target.forward(job)
    target.replay.flush()
    assert (target.counts.forwards, target.counts.replay_hits) == (len(first), 0)
    replayed = [target.forward(job)[1] for job in second]
    assert (target.counts.forwards, target.counts.replay_hits) == (len(first), len(second))
    assert target.jobs_done == len(first)
    assert read_counts(str(tmp_path / "run")).__dict__ == {"forwards": len(first), "replay_hits": len(second)}

    plain, _ = _tiny_run(model_dir, tmp_path / "plain", None)
    for job, got in zip(second, replayed):
        want = plain.forward(job)[1]
        assert np.array_equal(got.input_ids_BS, want.input_ids_BS) and np.array_equal(got.loss_mask_BS, want.loss_mask_BS)
        for row, n in enumerate(want.lengths_B.tolist()):
            assert np.array_equal(got.hidden_BSD[row, :n], want.hidden_BSD[row, :n]), np.abs(got.hidden_BSD[row, :n] - want.hidden_BSD[row, :n]).max()

    (victim, *_) = _entry_files(tmp_path / "replay")
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    victim.write_bytes(bytes(raw))
    for job in second:
        target.forward(job)
    target.replay.flush()
    assert (target.counts.forwards, target.counts.replay_hits) == (len(first) + 1, 2 * len(second) - 1)
    assert victim.exists()  # written again by that forward


@pytest.mark.parametrize("value, message", [
    ("rel/folder", "is not off, local, an absolute folder or a URI"),
    ("s3://KEY:SECRET@bucket/replay", "carries credentials"),
])
def test_a_bad_replay_setting_is_refused_in_one_line(value: str, message: str) -> None:
    from app.config.schema import PoolConfig

    with pytest.raises(ValueError) as e:
        PoolConfig(replay=value)
    assert message in str(e.value) and "\n" not in str(e.value) and "SECRET" not in str(e.value)
    with pytest.raises(ValueError, match=r"pool.replay_max_gb=0 must be > 0 GiB"):
        PoolConfig(replay="local", replay_max_gb=0)
    assert PoolConfig(replay=False).replay == "off"  # YAML 1.1's bare `off`
    assert PoolConfig(replay="s3://bucket/replay?endpoint_override=h:9000").replay.startswith("s3://")


def test_the_replay_bench_measures_the_tiny_shape_side_by_side(tmp_path: Path) -> None:
    """bench replay on the tiny target's shape: every figure measured (> 0), the payload its exact size
    (8 sequences x 96 tokens x 2 layers x 64 wide, float32), and the next epoch's job served from the store."""
    from app.bench.transport.replay import measure, tiny_shape

    shape = tiny_shape()
    assert (shape.seqs_per_job, shape.seq_len, shape.layer_ids) == (8, 96, [1, 3])
    m = measure(shape, tmp_path, repeats=1)
    assert m["payload_mb"] * 1e6 == 8 * 96 * 2 * 64 * 4
    assert m["target_s"] > 0 and m["write_s"] > 0 and m["read_s"] > 0 and m["cold_s"] > 0


@pytest.mark.slow  # the tiny config's plan (the cached tiny target) and two epochs of training, three times
def test_training_on_replayed_features_gives_the_same_tau(tmp_path: Path) -> None:
    """The run's trainer in one process (as bench quality trains: deterministic for a seed), two epochs of the
    tiny config, fed by the TargetActor: without replay; with a fresh store (epoch 2 replayed); and repeated on
    that store (every job replayed). The repeat has the first's weights bit for bit; against no replay the
    features differ by float32 rounding (a sequence padded to another job's length: at most ~1e-5 here), so
    the weights differ at that level and tau is the same."""
    import torch
    from transformers import AutoModelForCausalLM

    from actors.target import TargetActor
    from app.bench.runs.quality import drafter_tau
    from app.config.load import load_config
    from app.config.run_sections import FaultsConfig
    from app.model.build import build_or_load_drafter
    from app.model.loss import TrainBatch
    from app.replay.spec import ReplaySpec
    from app.run.plan import plan_run
    from app.training.trainer import DrafterTrainer

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "conf/tiny.yaml", [f"checkpoint.dir={tmp_path / 'run'}", "train.epochs=2",
                                                f"tiny.cache_dir={root / '.cache/tiny'}", "eval.num_prompts=4"])
    plan = plan_run(cfg, on_gpu=False, log=lambda _: None, progress=False)
    cpu, per_step = torch.device("cpu"), cfg.topology.num_drafters * cfg.train.grad_accum
    model = AutoModelForCausalLM.from_pretrained(plan.model_dir, dtype=torch.float32).eval()

    def train(replay: ReplaySpec | None):
        target = TargetActor(0, plan.model_dir, plan.layer_ids, cfg.model, "cpu", 1, plan.dataset, FaultsConfig(),
                             str(tmp_path / "run"), replay=replay)
        drafter, head, arch = build_or_load_drafter(plan.model_dir, None, cfg.drafter, plan.layer_ids,
                                                    plan.mask_token_id, cpu, torch.float32, cfg.train.seed)
        trainer = DrafterTrainer(drafter, head, cfg.drafter, cfg.train, plan.total_steps, cpu, total_jobs=len(plan.jobs))
        jobs = list(plan.jobs)
        for start in range(0, len(jobs), per_step):
            for job in jobs[start:start + per_step]:
                trainer.micro_step(TrainBatch.from_hidden_batch(target.forward(job)[1], "cpu", torch.float32), job.job_id)
            trainer.finish_step()
        if target.replay:
            target.replay.flush()
        tau = drafter_tau(plan, cfg, model, drafter.eval(), head, arch)[0]
        return {k: v.clone() for k, v in drafter.state_dict().items()}, (target.counts.forwards, target.counts.replay_hits), tau

    spec = ReplaySpec(str(tmp_path / "replay"), 1 << 30)
    plain, first, again = train(None), train(spec), train(spec)
    epoch0 = sum(1 for j in plan.jobs if j.epoch == 0)
    assert plain[1] == (len(plan.jobs), 0)
    assert first[1] == (epoch0, len(plan.jobs) - epoch0) and again[1] == (0, len(plan.jobs))
    assert all(torch.equal(first[0][k], again[0][k]) for k in first[0]) and first[2] == again[2]
    drift = max(float((plain[0][k] - first[0][k]).abs().max()) for k in plain[0])
    print(f"tau plain {plain[2]} replayed {first[2]} repeated {again[2]}; weights drift {drift:.2e}")
    assert 0 < drift < 1e-3 and plain[2] == first[2] > 1.0


def test_a_uri_store_reads_writes_once_and_measures_through_pyarrow(tmp_path: Path) -> None:
    """UriFolder (the checkpoint storage's pyarrow.fs, here over file://) behaves as the local folder: write once,
    a corrupt entry refused, the budget measured from the listing."""
    from app.replay.backend import UriFolder, open_backend

    assert isinstance(open_backend(f"file://{tmp_path}/a"), LocalFolder)  # file:// gets the atomic local folder
    backend = UriFolder(f"file://{tmp_path}/b")
    store = ReplayStore(backend, KEY, 1 << 30, log=lambda _: None)
    ids, _ = _seq(5, 9)
    assert store.put(ids, _rows(5, 9)) and not store.put(ids, _rows(6, 9))
    assert np.array_equal(store.get(ids).rows, _rows(5, 9))
    assert backend.used_bytes() == sum(p.stat().st_size for p in (tmp_path / "b").rglob("*") if p.is_file())
    (path,) = _entry_files(tmp_path / "b")
    path.write_bytes(path.read_bytes()[:-1])
    assert store.get(ids) is None and store.stats.bad == 1 and not path.exists()


def test_a_dead_writers_temporary_file_is_removed_and_a_planted_link_never_read(tmp_path: Path) -> None:
    import os

    store = _store(tmp_path)
    ids, _ = _seq(8, 5)
    name = sequence_name(ids)
    folder = tmp_path / KEY.folder / name[:2]
    folder.mkdir(parents=True)
    stale, fresh = folder / ".tmp-1-dead", folder / ".tmp-2-live"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"y")
    os.utime(stale, (0, 0))
    assert LocalFolder(tmp_path).clean_stale(KEY.folder) == 1 and not stale.exists() and fresh.exists()
    secret = tmp_path / "secret"
    secret.write_bytes(encode_entry(name, _rows(8, 5), "float32"))
    (folder / f"{name}.feat").symlink_to(secret)
    assert store.get(ids) is None  # O_NOFOLLOW: a link planted under an entry's name is a miss


def test_an_s3_store_refuses_a_second_writer_by_a_conditional_put(s3) -> None:
    """On S3 (moto on loopback, the real pyarrow and boto3 clients) an entry is created with If-None-Match: two
    writers of one sequence, one wins and the other's bytes never land; a second run's store reads the first's."""
    from app.replay.backend import open_backend

    uri = s3.uri("replay")
    first, second = (ReplayStore(open_backend(uri), KEY, 1 << 30, log=lambda _: None) for _ in range(2))
    assert first.backend.conditional is not None
    ids, _ = _seq(11, 6)
    assert first.put(ids, _rows(11, 6)) and not second.put(ids, _rows(12, 6))
    assert second.stats.refused == 1 and np.array_equal(second.get(ids).rows, _rows(11, 6))
    assert first.backend.used_bytes() > 6 * 8 * 4


def test_a_failing_write_is_said_and_the_writer_lives_on(tmp_path: Path) -> None:
    """A store error on the writer thread (a full disk, a bucket's error) is one line per job; the next jobs are
    still written and a lookup never waits forever on a job that failed."""
    from app.replay.target_side import TargetReplay

    said: list[str] = []
    store = _store(tmp_path, log=said.append)
    replay = TargetReplay(store)
    seqs = [_seq(20, 5), _seq(21, 6)]
    real_create, calls = store.backend.create, []

    def flaky(rel: str, data: bytes) -> bool:
        calls.append(rel)
        if len(calls) == 1:
            raise RuntimeError("SlowDown: please reduce your request rate")
        return real_create(rel, data)

    store.backend.create = flaky
    replay.keep(_batch_of(1, seqs[:1], [20]))
    replay.keep(_batch_of(2, seqs[1:], [21]))
    replay.flush()
    assert len(said) == 1 and "job 1" in said[0] and "SlowDown" in said[0]
    assert replay.lookup(3, seqs[:1]) is None and replay.lookup(4, seqs[1:]) is not None


def test_a_store_that_fails_is_a_miss_and_an_unusable_root_is_refused_before_any_actor(tmp_path: Path) -> None:
    from app.config.checks import check_replay_root
    from app.config.errors import ConfigError
    from app.replay.spec import ReplaySpec
    from app.replay.target_side import TargetReplay

    said: list[str] = []
    store = _store(tmp_path, log=said.append)
    ids, _ = _seq(30, 4)
    store.put(ids, _rows(30, 4))

    def broken(rel: str) -> bytes:
        raise OSError("Connection reset by peer")

    store.backend.read = broken
    assert store.get(ids) is None and store.get(ids) is None  # the target computes the job
    assert len(said) == 1 and "said once" in said[0]
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ConfigError, match=r"pool.replay=.* cannot hold the replay store: .*pool.replay=off"):
        check_replay_root(str(tmp_path / "file" / "store"))
    check_replay_root("local")
    assert TargetReplay.open(ReplaySpec(str(tmp_path / "file" / "store"), 1 << 30), str(tmp_path / "file"),
                             [1], "float32", log=said.append) is None
    assert "cannot be opened" in said[-1]


def test_the_summary_sums_every_target_incarnation_s_own_counts(tmp_path, monkeypatch) -> None:
    """summary.json's replay_forwards / replay_hits: each incarnation's count file (a restarted target's old one
    too), summed; nothing when replay is off."""
    import json

    from app.replay import target_side
    from app.replay.target_side import TargetCounts, replay_summary, save_counts

    run = tmp_path / "run"
    save_counts(str(run), 0, TargetCounts(forwards=3, replay_hits=5))
    save_counts(str(run), 1, TargetCounts(forwards=4, replay_hits=0))
    folder = next(p.parent for p in tmp_path.rglob("target-1-*.json"))
    (folder / "target-0-999999.json").write_text(json.dumps({"forwards": 2, "replay_hits": 1}))  # an earlier life
    assert replay_summary("local", str(run)) == {"replay_forwards": 9, "replay_hits": 6}
    assert replay_summary("off", str(run)) == {}
    assert target_side.COUNTS_DIR in str(folder)
