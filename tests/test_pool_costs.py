"""Jobs carry their drafter cost (query rows) and the pool deals it so ranks' steps cost the same;
the driver refuses a pool the object store cannot hold. No Ray."""
from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch

from app.bench.feeding.simulate import SimSetup, simulate
from app.pool.holdings import check_object_store
from app.config.errors import ConfigError
from app.config.drafter_sections import TrainConfig
from app.config.schema import Config, PoolConfig, TopologyConfig
from app.data import costs
from app.data.costs import sequence_rows, with_costs
from app.messages import JobSpec
from app.model.loss import sample_anchors

DEMO_MIX = [1, 4, 5, 6, 7, 11]
DRAFTER_COST = [0.30, 0.25, 0.20, 0.15, 0.10, 0.05]


def test_sequence_rows_count_the_anchors_the_loss_samples():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 60, size=80)
    masks = [(rng.random(n) < 0.6).astype(np.uint8) for n in lengths]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    rows = sequence_rows(np.concatenate(masks), offsets, block_size=8, num_anchors=7)
    want = [8 * len(sample_anchors(torch.tensor(m), len(m), 8, 7, torch.Generator().manual_seed(1))) for m in masks]
    assert rows.tolist() == want
    jobs = with_costs([JobSpec(0, 0, 0, 0, (1, 3), 10), JobSpec(1, 0, 1, 0, (2,), 10)], rows)
    assert [j.cost for j in jobs] == [want[1] + want[3], want[2]]


def test_sequence_rows_a_few_tokens_at_a_time_equal_one_pass(monkeypatch):
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 300, size=500)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    mask = (rng.random(int(offsets[-1])) < 0.6).astype(np.uint8)
    whole = sequence_rows(mask, offsets, block_size=8, num_anchors=7)
    monkeypatch.setattr(costs, "CHUNK_TOKENS", 100)  # many sequences longer than a chunk, and many shorter
    assert np.array_equal(sequence_rows(mask, offsets, block_size=8, num_anchors=7), whole)
    assert whole.any()


def _spreads(rows, seed):
    mean = sum(m * c for m, c in zip(DEMO_MIX, DRAFTER_COST)) / sum(DEMO_MIX)
    setup = SimSetup(DEMO_MIX, 3000, DRAFTER_COST, [5 * mean / (3 * 1.1)] * 6, ranks=3, accum=4, seed=seed, rows=rows)
    r = simulate(setup)
    return sorted(r.rank_cost_spreads()[3:-3]), r


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
def test_dealt_steps_stay_within_ten_percent_across_ranks_over_a_long_run(seed):
    dealt, r = _spreads([c * 1000 for c in DRAFTER_COST], seed)
    blind, _ = _spreads((), seed)
    assert len(dealt) > 200
    assert statistics.mean(dealt) <= 0.07 and dealt[int(0.9 * len(dealt))] <= 0.10, (
        statistics.mean(dealt), dealt[int(0.9 * len(dealt))], dealt[-1])
    assert statistics.mean(blind) > 0.2  # the same run without costs: ranks wait for each other
    m = r.measures()  # the mixing guarantees hold while dealing
    assert m["step_tv"] <= 1.15 * m["step_tv_floor"] and m["tail_single"] == 0 and m["backlog"] <= 0.36, m
    assert m["barrier_idle"] < 0.05, m


def _cfg(capacity_bytes: int, capacity: int = 24) -> Config:
    return Config(pool=PoolConfig(capacity=capacity, capacity_bytes=capacity_bytes, min_ready=1),
                  topology=TopologyConfig(num_drafters=3), train=TrainConfig(grad_accum=4))


def test_a_pool_the_object_store_cannot_hold_is_refused_in_one_line():
    gib = 2**30
    job = gib // 2
    # Leased payloads count inside capacity_bytes; items: 24 + 3 x (4 + 1) leased = 39 jobs = 19.5 GiB.
    check_object_store(_cfg(16 * gib), job, 16 * gib)
    check_object_store(_cfg(64 * gib, capacity=1), job, 16 * gib)  # (1 + 15) x 0.5 = 8 GiB: the items bound
    with pytest.raises(ConfigError) as e:
        check_object_store(_cfg(20 * gib), job, 16 * gib)  # min(20, 19.5) > 16
    msg = str(e.value)
    assert "\n" not in msg and "pool.capacity_bytes" in msg and "object store" in msg and "19.5 GiB" in msg
    check_object_store(_cfg(64 * gib), job, 0)  # Ray did not say: no check
