"""Buckets, job packing and the linear interleaved schedule of app/data/schedule.py."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.config.schema import DataConfig
from app.messages import make_job_id
from app.data.schedule import assign_bucket, assign_buckets, build_schedule, interleave, schedule_summary

BOUNDS = [32, 64, 96, 128, 160, 192]


def _cfg(**kw) -> DataConfig:
    return replace(DataConfig(), **{"bucket_boundaries": BOUNDS, "tokens_per_job": 512, "max_length": 192, **kw})


def _lengths(n=600, seed=0, lo=17, hi=192):
    return np.random.default_rng(seed).integers(lo, hi + 1, n)


@pytest.mark.parametrize(
    "length,bucket",
    [(1, 0), (32, 0), (33, 1), (64, 1), (65, 2), (96, 2), (97, 3), (160, 4), (161, 5), (192, 5), (500, 5)],
)
def test_bucket_at_the_boundaries(length, bucket):
    assert assign_bucket(length, BOUNDS) == bucket
    assert assign_buckets(np.array([length]), BOUNDS).tolist() == [bucket]


def test_every_job_fits_the_token_budget_and_every_sequence_is_scheduled_once():
    lengths = _lengths()
    cfg = _cfg()
    specs = build_schedule(lengths, cfg, epoch=3, est_bytes_per_token=10)
    seen = sorted(i for s in specs for i in s.seq_indices)
    assert seen == list(range(len(lengths)))
    for k, s in enumerate(specs):
        seq_lens = lengths[list(s.seq_indices)]
        assert s.padded_tokens == seq_lens.max() * len(seq_lens) <= cfg.tokens_per_job
        assert set(assign_buckets(seq_lens, BOUNDS).tolist()) == {s.bucket}
        assert (s.index, s.epoch, s.job_id) == (k, 3, make_job_id(3, k))
        assert s.est_bytes == s.padded_tokens * 10 + 8 * len(s.seq_indices)  # + lengths_B


def test_a_sequence_longer_than_the_budget_forms_its_own_job():
    lengths = np.array([40, 300, 50, 45, 290])
    specs = build_schedule(lengths, _cfg(bucket_boundaries=[64, 320], tokens_per_job=256), epoch=0)
    singles = sorted(s.seq_indices for s in specs if s.bucket == 1)
    assert singles == [(1,), (4,)]
    assert all(s.padded_tokens <= 256 for s in specs if s.bucket == 0)


def test_packing_keeps_padding_low():
    lengths = _lengths(3000)
    specs = build_schedule(lengths, _cfg(tokens_per_job=2048), epoch=0)
    padded = sum(s.padded_tokens for s in specs)
    assert lengths.sum() / padded > 0.9  # sorted runs inside a bucket pack tightly


def _min_window_counts(order: list[int], bucket: int, k: int) -> int:
    hits = np.concatenate([[0], np.cumsum(np.asarray(order) == bucket)])
    return int((hits[k:] - hits[:-k]).min())


def _check_windows(order: list[int], counts: list[int], ks) -> None:
    n = len(order)
    for b, nb in enumerate(counts):
        for k in ks:
            if 1 <= k <= n:
                assert _min_window_counts(order, b, k) >= math.floor(k * nb / n) - 1, (b, k, counts)


def test_windows_of_the_real_schedule_hold_every_bucket_in_proportion():
    lengths = np.concatenate([_lengths(900, seed=1), np.full(150, 30), np.full(60, 190)])
    cfg = _cfg()
    for epoch in range(3):
        specs = build_schedule(lengths, cfg, epoch)
        order = [s.bucket for s in specs]
        counts = [order.count(b) for b in range(len(BOUNDS))]
        _check_windows(order, counts, ks=range(1, len(order) + 1))


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 80), min_size=1, max_size=8).filter(lambda c: sum(c) > 0),
    seed=st.integers(0, 2**16),
)
def test_interleave_window_bound_for_any_bucket_sizes(counts, seed):
    priority = np.random.default_rng(seed).permutation(len(counts)).tolist()
    order = [b for b, _ in interleave(counts, priority)]
    assert sorted(order) == sorted(b for b, n in enumerate(counts) for _ in range(n))
    n = len(order)
    _check_windows(order, counts, ks=sorted({1, 2, 3, 5, 8, 13, n // 4, n // 2, n - 1, n}))
    # Within a bucket, jobs come in their bucket order (0, 1, 2, ...).
    per_bucket: dict[int, list[int]] = {}
    for b, i in interleave(counts, priority):
        per_bucket.setdefault(b, []).append(i)
    assert all(v == list(range(len(v))) for v in per_bucket.values())


def test_same_seed_same_schedule_other_epoch_or_seed_differs():
    lengths = _lengths()
    a = build_schedule(lengths, _cfg(seed=7), epoch=2)
    b = build_schedule(lengths.copy(), _cfg(seed=7), epoch=2)
    assert a == b
    other_epoch = build_schedule(lengths, _cfg(seed=7), epoch=3)
    other_seed = build_schedule(lengths, _cfg(seed=8), epoch=2)
    key = lambda specs: [s.seq_indices for s in specs]  # noqa: E731
    assert key(a) != key(other_epoch) and key(a) != key(other_seed)
    # Same multiset of work per epoch: every sequence once.
    assert sorted(i for s in other_epoch for i in s.seq_indices) == list(range(len(lengths)))


def test_schedule_summary_counts():
    lengths = np.array([20, 30, 40, 100, 190, 191])
    cfg = _cfg(tokens_per_job=400)
    summ = schedule_summary(lengths, cfg, epochs=2)
    assert [b["sequences"] for b in summ["buckets"]] == [2, 1, 0, 1, 0, 2]
    assert [b["tokens"] for b in summ["buckets"]] == [50, 40, 0, 100, 0, 381]
    assert summ["jobs_per_epoch"] == [len(build_schedule(lengths, cfg, e)) for e in range(2)]
    assert summ["epochs"][0]["padded_tokens"] == sum(s.padded_tokens for s in build_schedule(lengths, cfg, 0))


def test_bad_boundaries_are_rejected():
    with pytest.raises(ValueError, match="strictly increasing"):
        build_schedule(np.array([10]), _cfg(bucket_boundaries=[64, 32]), epoch=0)
