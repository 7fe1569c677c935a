"""Planning a run before Ray: the tiny config's plan, and resume refusing other data."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.training.checkpoint import TrainState, save_checkpoint
from app.config.load import ConfigError, load_config
from app.run.plan import plan_run
from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # builds (or reuses) the tiny target


def _cfg(run_dir: Path, *extra: str):
    return load_config(ROOT / "conf/tiny.yaml", [f"checkpoint.dir={run_dir}", f"tiny.cache_dir={ROOT / '.cache/tiny'}",
                                                 *extra])


def _checkpoint(run_dir: Path, fingerprint: str, ledger: list[int]) -> None:
    save_checkpoint(run_dir, TrainState(step=4, epoch=0, ledger=ledger, drafter={"w": torch.zeros(1)},
                                        extra={"data_fingerprint": fingerprint}), keep=1)


def test_plan_of_the_tiny_config(tmp_path: Path) -> None:
    plan = plan_run(_cfg(tmp_path), on_gpu=False)
    assert len(plan.jobs) == len({j.job_id for j in plan.jobs}) > 0
    assert {j.epoch for j in plan.jobs} == set(range(6))
    assert plan.mask_token_id == 3 and plan.layer_ids == [1, 3]
    assert plan.resume_from is None and len(plan.data_fingerprint) == 16


def test_resume_takes_the_ledger_of_a_matching_checkpoint(tmp_path: Path) -> None:
    fingerprint = plan_run(_cfg(tmp_path), on_gpu=False).data_fingerprint
    _checkpoint(tmp_path, fingerprint, [1, 2])
    plan = plan_run(_cfg(tmp_path, "train.epochs=8"), on_gpu=False)  # extending a run is allowed
    assert plan.resume_step == 4 and plan.resume_ledger == [1, 2]


def test_lowering_train_epochs_on_resume_keeps_only_the_scheduled_ledger_ids(tmp_path: Path) -> None:
    """Issue 35, C6: a checkpoint of the 6-epoch run holding every job of epochs 0-3, resumed with
    train.epochs=2: only epochs 0 and 1's ids are the resume ledger, so the resumed run has no job
    left and says so, instead of counting epochs 2-3 as done jobs it never schedules (before:
    jobs_remaining was minus two epochs' worth)."""
    from app.messages import make_job_id

    plan = plan_run(_cfg(tmp_path), on_gpu=False)
    done = [j.job_id for j in plan.jobs if j.epoch < 4]
    _checkpoint(tmp_path, plan.data_fingerprint, done)
    lowered = plan_run(_cfg(tmp_path, "train.epochs=2"), on_gpu=False)
    assert lowered.resume_ledger == [j for j in done if j < make_job_id(2, 0)]
    assert lowered.jobs_remaining == 0 and len(lowered.resume_ledger) == len(lowered.jobs)


def test_resume_refuses_a_checkpoint_of_other_data(tmp_path: Path) -> None:
    _checkpoint(tmp_path, "0123456789abcdef", [1, 2])
    with pytest.raises(ConfigError, match=r"holds a run on different data .* use a new checkpoint.dir"):
        plan_run(_cfg(tmp_path), on_gpu=False)


def test_job_byte_estimates_equal_the_real_payloads(tmp_path: Path) -> None:
    """Issue 12 item 3: a job's est_bytes is exactly what the target puts in the object store (hidden
    states at the real dtype, ids, mask and lengths_B), for the largest job and a few others."""
    from actors.target import TargetActor
    from app.config.run_sections import FaultsConfig

    cfg = _cfg(tmp_path)
    plan = plan_run(cfg, on_gpu=False)
    plan.use_device(False)
    jobs = list(plan.jobs)
    biggest = max(jobs, key=lambda j: j.est_bytes)
    assert biggest.est_bytes == plan.jobs.max_payload_bytes()
    target = TargetActor(0, plan.model_dir, plan.layer_ids, cfg.model, "cpu", 1, plan.dataset, FaultsConfig(),
                         str(tmp_path))
    for job in [biggest, *jobs[:3]]:
        meta, _ = target.forward(job)
        assert meta.nbytes == job.est_bytes > job.padded_tokens * plan.bytes_per_token  # lengths_B counted


def test_a_byte_budget_below_one_global_step_is_refused_in_one_line(tmp_path: Path) -> None:
    plan = plan_run(_cfg(tmp_path), on_gpu=False)
    plan.use_device(False)
    step = 3 * (1 + 1) * plan.jobs.max_payload_bytes()  # tiny: 3 drafters, grad_accum 1, one prefetched
    plan_run(_cfg(tmp_path, f"pool.capacity_bytes={step}"), on_gpu=False).use_device(False)
    with pytest.raises(ConfigError) as e:
        plan_run(_cfg(tmp_path, f"pool.capacity_bytes={step - 1}"), on_gpu=False).use_device(False)
    msg = str(e.value)
    assert "\n" not in msg and f"pool.capacity_bytes={step - 1}" in msg and f"at least {step}" in msg


def test_pretokenized_ids_outside_the_vocabulary_are_refused_before_any_actor(tmp_path: Path) -> None:
    """Issue 12 item 1: an id >= the target's vocab_size would make its job's forward fail on every
    target. Under on_error=raise the plan stops with file, line and id; under skip the record is
    dropped and counted as out_of_vocab, and the others train."""
    import json

    from app.data.records import DataError

    vocab = plan_run(_cfg(tmp_path / "probe"), on_gpu=False).info.vocab_size
    rows = [{"input_ids": [5 + i % 7 for i in range(60)], "loss_mask": [1] * 60} for _ in range(3)]
    rows[1]["input_ids"][10] = vocab  # one past the last embedding row
    data = tmp_path / "pretok.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    files = f"data.train_files=[{data}]"
    with pytest.raises(DataError) as e:
        plan_run(_cfg(tmp_path / "raise", files), on_gpu=False)
    msg = str(e.value)
    assert "\n" not in msg and f"{data}:2:" in msg and f"token id {vocab} is outside" in msg and "on_error=skip" in msg
    plan = plan_run(_cfg(tmp_path / "skip", files, "data.on_error=skip"), on_gpu=False)
    assert len(plan.dataset) == 2
    assert plan.dataset.summary.total().dropped["out_of_vocab"] == 1
    assert int(plan.dataset.tokens.max()) < vocab
