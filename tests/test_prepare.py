"""`python -m app.prepare`: deterministic files that account for every record."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from app.config.drafter_sections import DrafterConfig, TrainConfig
from app.config.run_sections import CheckpointConfig
from app.config.schema import Config, DataConfig, ModelConfig
from app.config.tiny_section import TinyConfig
from app.prepare import run_prepare
from tests.helpers import ROOT


def _small_cfg(cache_dir: str, extra_files: list[str] = ()) -> Config:
    tiny = replace(TinyConfig(), cache_dir=cache_dir, num_layers=2, num_train_prompts=24, response_length=24)
    data = replace(DataConfig(), max_length=40, bucket_boundaries=[16, 24, 32, 40], tokens_per_job=96,
                   on_error="skip", train_files=list(extra_files))
    return Config(model=ModelConfig(target="tiny"), tiny=tiny, data=data,
                  drafter=DrafterConfig(block_size=4, mask_token_id=3), train=replace(TrainConfig(), epochs=2),
                  checkpoint=CheckpointConfig(dir=f"{cache_dir}/run"))  # the data cache goes under it


@pytest.mark.slow
def test_prepare_twice_gives_identical_files_that_account_for_every_record(tmp_path):
    from app.tiny.build import ensure_tiny_target

    cfg = _small_cfg(str(tmp_path / "cache"))
    art = ensure_tiny_target(cfg.tiny)
    # The generated data plus a file with every kind of reject, so each count is exercised.
    extra = tmp_path / "extra.jsonl"
    extra.write_text("\n".join([
        json.dumps({"messages": [{"role": "user", "content": "ba"}, {"role": "assistant", "content": "be"}]}),
        "{broken",
        json.dumps({"input_ids": [5] * 30, "loss_mask": [1] * 30}),
    ]) + "\n")
    cfg = replace(cfg, data=replace(cfg.data, train_files=[art.train_file, str(extra)]))

    logs: list[str] = []
    first = run_prepare(cfg, tmp_path / "a", log=logs.append)
    second = run_prepare(cfg, tmp_path / "b", log=logs.append)
    # The first call tokenized and filled the run's data cache; the second (like a run) loaded it.
    assert logs[0].startswith("data: tokenized") and str(tmp_path / "cache" / "run" / "data-cache") in logs[0]
    assert sum(line.startswith("data: loaded") for line in logs) == 1
    for name in ("summary.json", "schedule.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert first == second

    s = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert s["records"] == 24 + 3 and s["accounted"]
    assert s["kept"] + sum(s["dropped"].values()) == s["records"]
    assert s["dropped"]["malformed"] == 1 and s["dropped"]["too_few_loss_tokens"] >= 1
    assert s["truncated"] >= 1  # responses run past max_length=40
    assert s["files"][str(extra)]["records"] == 3
    assert sum(b["sequences"] for b in s["buckets"]) == s["kept"]
    assert sum(b["tokens"] for b in s["buckets"]) == s["tokens"]

    rows = [json.loads(line) for line in (tmp_path / "a" / "schedule.jsonl").read_text().splitlines()]
    assert len(rows) == sum(s["jobs_per_epoch"]) and {r["epoch"] for r in rows} == {0, 1}
    for epoch in (0, 1):
        seqs = sorted(i for r in rows if r["epoch"] == epoch for i in r["sequences"])
        assert seqs == list(range(s["kept"]))
    assert all(r["padded_tokens"] <= 96 for r in rows)


@pytest.mark.slow
def test_prepare_cli_on_the_tiny_config_accounts_for_every_record(tmp_path):
    """`python -m app.prepare` on conf/tiny.yaml (the shared tiny build, as the other tests use): exit 0,
    every generated record accounted for, lengths spread over the buckets, one schedule per epoch of
    tiny's train.epochs, and the one line it prints says what summary.json holds. (It asserted no time
    despite its old name, `..._is_fast`; the time is printed for the record.)"""
    conf = ROOT / "conf" / "tiny.yaml"
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "app.prepare", "--config", str(conf), "--out", str(tmp_path / "out"),
         f"tiny.cache_dir={ROOT / '.cache/tiny'}", f"checkpoint.dir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    took = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    print(f"RESULT prepare_tiny_s={took:.1f} records={s['records']} kept={s['kept']} jobs_per_epoch={s['jobs_per_epoch'][0]}")
    assert s["accounted"] and s["records"] == 192
    assert s["kept"] + sum(s["dropped"].values()) == s["records"]
    assert sum(b["sequences"] for b in s["buckets"]) == s["kept"]
    assert sum(1 for b in s["buckets"] if b["sequences"] > 0) >= 5  # lengths spread over the buckets
    assert len(s["jobs_per_epoch"]) == 6 and all(n > 0 for n in s["jobs_per_epoch"])  # tiny's train.epochs
    rows = (tmp_path / "out" / "schedule.jsonl").read_text().splitlines()
    assert len(rows) == sum(s["jobs_per_epoch"])
    assert f"records={s['records']} kept={s['kept']} " in proc.stdout and f"jobs_per_epoch={s['jobs_per_epoch']}" in proc.stdout
