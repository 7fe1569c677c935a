"""Data at scale: shards read exactly like whole files, Ray Data tokenizes exactly like one process, and
the tokenized-data cache hits, misses on a changed file and misses on a changed setting."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from app.config.drafter_sections import DrafterConfig
from app.config.run_sections import CheckpointConfig
from app.config.schema import Config, DataConfig, ModelConfig
from app.data import pipeline
from app.data.dataset import TokenizedDataset, load_dataset
from app.data.formats import iter_records
from app.data.records import DataError
from app.data.shards import plan_shards, read_shard, whole_file
from tests.chat_toys import QWEN_TEMPLATE, THREE_TURNS, bpe_tokenizer

GOOD = {"messages": THREE_TURNS}
SHAREGPT = {"conversations": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
                              for m in THREE_TURNS]}
SHORT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ten"}]}
LONG = {"messages": [{"role": "user", "content": "count"},
                     {"role": "assistant", "content": " ".join(["one two three four five six seven"] * 30)}]}
TOKENIZED = {"input_ids": list(range(5, 45)), "loss_mask": [0] * 8 + [1] * 32}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tokenizer folder (what AutoTokenizer.from_pretrained reads in the Ray Data workers)."""
    path = tmp_path_factory.mktemp("tok")
    bpe_tokenizer(QWEN_TEMPLATE).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _mixed_files(tmp: Path, malformed: bool = True) -> list[str]:
    """Two JSONL files and a Parquet file of several row groups, every format, blank and broken lines."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines_a = [GOOD, SHORT, "", LONG, SHAREGPT, TOKENIZED] * 4
    if malformed:
        lines_a[7] = "{not json"
        lines_a[13] = json.dumps({"text": "no known keys"})
    a = tmp / "a.jsonl"
    a.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in lines_a))  # no final newline
    b = tmp / "b.jsonl"
    b.write_text("".join(json.dumps(r) + "\n" for r in [SHAREGPT, GOOD, TOKENIZED, LONG, SHORT] * 3))
    rows = [{"messages": r.get("messages"), "conversations": r.get("conversations")}
            for r in [GOOD, SHAREGPT, SHORT, LONG] * 5]
    if malformed:
        rows[9] = {"messages": None, "conversations": None}
    c = tmp / "c.parquet"
    pq.write_table(pa.Table.from_pylist(rows), c, row_group_size=6)
    return [str(a), str(b), str(c)]


def _data(**kw) -> DataConfig:
    return replace(DataConfig(), **{"max_length": 160, "bucket_boundaries": [64, 128, 160], "on_error": "skip", **kw})


def _same(a: TokenizedDataset, b: TokenizedDataset) -> None:
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    np.testing.assert_array_equal(a.offsets, b.offsets)
    assert a.tokens.dtype == b.tokens.dtype and a.loss_mask.dtype == b.loss_mask.dtype
    assert a.summary.to_dict() == b.summary.to_dict()


def test_shards_read_the_records_of_the_whole_file_with_their_line_numbers(tmp_path) -> None:
    for path in _mixed_files(tmp_path):
        whole = [(n, repr(r)) for s in whole_file(path) for n, r in read_shard(s)]
        for per in (1, 2, 5, 7, 1000):
            shards = plan_shards(path, per)
            assert [(n, repr(r)) for s in shards for n, r in read_shard(s)] == whole, (path, per)
        assert [n for n, _ in iter_records(path)] == [n for n, _ in whole]
    a = _mixed_files(tmp_path)[0]
    numbers = [n for n, _ in iter_records(a)]
    assert 3 not in numbers and numbers[-1] == 24  # line 3 is blank; the last line has no newline
    assert sum(s.records for s in plan_shards(a, 5)) == 24


@pytest.mark.ray
@pytest.mark.slow
def test_ray_data_tokenizes_exactly_like_one_process(ray_cluster, tmp_path, model_dir, tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(pipeline, "RECORDS_PER_SHARD", 5)  # many shards out of a few records
    files = _mixed_files(tmp_path)
    for data in (_data(), _data(overlong="drop")):
        single = load_dataset(data, 4, tokenizer, files)
        parallel = pipeline.tokenize_files(data, 4, model_dir, tokenizer, files, workers=3, progress=False)
        _same(single, parallel)
        fs = single.summary.files
        assert fs[files[0]].dropped["malformed"] == 2 and fs[files[2]].dropped["malformed"] == 1
        assert all(fs[f].kept > 0 for f in files) and single.summary.total().truncated + \
            single.summary.total().dropped["overlong"] > 0
    # on_error=raise: the same first malformed record, by file and line, from both paths.
    with pytest.raises(DataError) as one:
        load_dataset(_data(on_error="raise"), 4, tokenizer, files)
    with pytest.raises(DataError) as many:
        pipeline.tokenize_files(_data(on_error="raise"), 4, model_dir, tokenizer, files, workers=3, progress=False)
    assert str(one.value) == str(many.value)
    assert str(one.value).startswith(f"{files[0]}:8: malformed record: invalid JSON")


def _cfg(tmp: Path, files: list[str], **data) -> Config:
    return Config(model=ModelConfig(target="tiny"), data=replace(_data(**data), train_files=files),
                  drafter=replace(DrafterConfig(), block_size=4), checkpoint=CheckpointConfig(dir=str(tmp / "run")))


def test_cache_hits_and_misses(tmp_path, model_dir, tokenizer) -> None:
    files = _mixed_files(tmp_path, malformed=False)
    logs: list[str] = []

    def load(cfg: Config) -> TokenizedDataset:
        return pipeline.load_or_tokenize(cfg, model_dir, tokenizer, files, progress=False, log=logs.append)

    cfg = _cfg(tmp_path, files)
    first = load(cfg)
    assert logs[0].startswith("data: tokenized") and str(tmp_path / "run" / "data-cache") in logs[0]
    assert any(files[2] in line and "records" in line for line in logs)  # one line per file
    logs.clear()
    hit = load(replace(cfg, data=replace(cfg.data, seed=7, tokens_per_job=999)))  # schedule settings: same entry
    assert logs[0].startswith("data: loaded") and len(logs) == 1
    assert isinstance(hit.tokens, np.memmap) and isinstance(hit.offsets, np.memmap)
    _same(first, hit)
    _same(first, load_dataset(cfg.data, 4, tokenizer, files))

    logs.clear()
    load(replace(cfg, data=replace(cfg.data, max_length=128, bucket_boundaries=[64, 128])))  # a data setting
    assert logs[0].startswith("data: tokenized")
    logs.clear()
    load(replace(cfg, drafter=replace(cfg.drafter, block_size=8)))  # the minimum of loss tokens
    assert logs[0].startswith("data: tokenized")

    logs.clear()
    Path(files[1]).write_text(Path(files[1]).read_text() + json.dumps(GOOD) + "\n")  # an input changed
    changed = load(cfg)
    assert logs[0].startswith("data: tokenized") and len(changed) == len(first) + 1
    logs.clear()
    load(cfg)
    assert logs[0].startswith("data: loaded")
    shared = replace(cfg, data=replace(cfg.data, cache_dir=str(tmp_path / "shared")))
    logs.clear()
    load(shared)
    assert logs[0].startswith("data: tokenized") and str(tmp_path / "shared") in logs[0]
    assert len(list((tmp_path / "shared").iterdir())) == 1  # one complete entry, no temp folder left


def test_a_malformed_record_is_not_cached(tmp_path, model_dir, tokenizer) -> None:
    files = _mixed_files(tmp_path)
    cfg = _cfg(tmp_path, files, on_error="raise")
    with pytest.raises(DataError, match=r"a\.jsonl:8: malformed record"):
        pipeline.load_or_tokenize(cfg, model_dir, tokenizer, files, progress=False, log=lambda _: None)
    assert not (tmp_path / "run" / "data-cache").exists() or not any((tmp_path / "run" / "data-cache").iterdir())


def test_auto_workers_stay_in_one_process_for_small_inputs(tmp_path) -> None:
    files = _mixed_files(tmp_path)
    asked = []
    assert pipeline.resolve_workers(_data(), files, lambda: asked.append(1) or 8.0) == 1 and not asked
    assert pipeline.resolve_workers(_data(num_workers=3), files, None) == 3


def test_a_uri_checkpoint_dir_keeps_the_cache_on_local_disk(tmp_path) -> None:
    from app.data.cache import cache_root

    cfg = _cfg(tmp_path, [])
    assert cache_root(cfg) == tmp_path / "run" / "data-cache"
    from app.storage.local_cache import cache_root as user_cache_root

    # A URI run's cache lives in this user's private root, not in the job's throwaway working-dir copy.
    uri_cache = cache_root(replace(cfg, checkpoint=CheckpointConfig(dir="s3://bucket/run")))
    assert uri_cache.parent.parent == user_cache_root() and uri_cache.name == "data-cache"
    assert uri_cache == cache_root(replace(cfg, checkpoint=CheckpointConfig(dir="s3://bucket/run")))  # stable
    assert cache_root(replace(cfg, data=replace(cfg.data, cache_dir="/shared/c"))) == Path("/shared/c")
