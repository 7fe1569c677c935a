"""The GPU bench: a clear exit without CUDA, and its --small rehearsal of the same code path on CPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from app.bench.compute import gpu, gpu_drafter


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_exits_nonzero_with_one_line(capsys):
    assert gpu.main([]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a CUDA GPU" in err[0] and "--small" in err[0]


def test_jobs_mix_every_bucket_round_robin():
    per_bucket = [[[10], [11]], [], [[30, 30]], [[40], [41], [42]]]
    assert gpu.mixed_jobs(per_bucket, 5) == [[10], [30, 30], [40], [11], [41]]


def test_asking_more_jobs_than_the_schedule_holds_takes_them_all_and_ends():
    """Item 3 of issue 23: --small at its defaults asks 26 jobs of a 22-job schedule; mixed_jobs never ended."""
    import signal

    def hang(*_):
        raise TimeoutError("mixed_jobs did not end")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(20)  # pure Python loop: the alarm interrupts it on the old code
    try:
        assert gpu.mixed_jobs([[[1]], [], [[2], [3]]], 9) == [[1], [2], [3]]
        setup = gpu.make_setup(gpu.parse(["--small"]))  # the defaults
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert 3 <= len(setup.jobs) <= 24 + 2  # warm-up + at least one timed job, never more than asked


def test_drafter_training_flops_count_only_valid_anchors():
    from types import SimpleNamespace

    arch = SimpleNamespace(hidden_size=8, block_size=4, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16,
                           feature_dim=24, num_layers=2, vocab_size=50)
    hb = SimpleNamespace(lengths_B=np.array([10, 3]), loss_mask_BS=np.ones((2, 10), np.uint8))
    one = gpu_drafter.drafter_train_flops(arch, hb, num_anchors=100)
    # Row 1 (length 3 < block 4) has no anchor; row 0 has positions 0..6 -> 7 anchors.
    hb1 = SimpleNamespace(lengths_B=np.array([10]), loss_mask_BS=np.ones((1, 10), np.uint8))
    assert one == gpu_drafter.drafter_train_flops(arch, hb1, num_anchors=100) > 0
    assert gpu_drafter.drafter_train_flops(arch, hb1, num_anchors=3) < one  # fewer anchors, less work


@pytest.mark.slow
def test_small_mode_runs_the_target_and_drafter_path_and_prints_result(capsys):
    assert gpu.main(["--small", "--jobs", "3", "--drafter-jobs", "1"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    vals = dict(kv.split("=") for kv in line.split()[1:])
    assert line.startswith("RESULT target_tok_s=")
    assert float(vals["target_tok_s"]) > 0 and float(vals["drafter_tok_s"]) > 0
    assert {"target_mfu", "drafter_mfu", "peak_gib"} <= set(vals)


@pytest.mark.slow
def test_acceptance_small_prints_every_check_and_skips_the_cuda_ones_without_cuda(capsys, tmp_path):
    """`bench gpu --acceptance --small` at its defaults: one RESULT line per check, in order."""
    from app.bench.compute.gpu_acceptance import CHECKS

    assert gpu.main(["--acceptance", "--small", "--results", str(tmp_path / "acc.jsonl")]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT check=")]
    vals = [dict(kv.split("=", 1) for kv in ln.split()[1:]) for ln in lines]
    assert [v["check"] for v in vals] == [c.name for c in CHECKS]
    for v, needs_cuda in zip(vals, [c.needs_cuda for c in CHECKS]):
        if torch.cuda.is_available() and v["check"] == "target_spread" and torch.cuda.device_count() < 2:
            assert v["status"] == "skipped" and v["reason"] == "needs_2_gpus", v
        elif torch.cuda.is_available():
            assert v["status"] == "pass", v
        elif needs_cuda or v["check"] == "environment":
            assert v["status"] == "skipped" and v["reason"] == "no_cuda", v
        else:
            assert v["status"] == "pass", v
    by = {v["check"]: v for v in vals}
    assert float(by["target_prefill"]["tok_s"]) > 0 and float(by["drafter_step"]["tok_s"]) > 0
    assert by["resume"]["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert by["resume"]["adamw"] == ("fused" if torch.cuda.is_available() else "foreach")
    assert by["collective"]["backend"] == ("nccl" if torch.cuda.is_available() else "gloo")
    assert by["transport"]["transport_equal"] == "1" and float(by["real_step"]["loss"]) > 0
