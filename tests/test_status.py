"""The driver's status line and monitor, fed by hand (no Ray)."""
from __future__ import annotations

from app.config.schema import PoolConfig
from app.messages import StepRecord
from app.pool.hs_pool import HSPool
from app.run.outputs.monitor import RunMonitor, bottleneck


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _rec(rank: int, step: int, tokens: int = 100, wait: float = 0.0) -> StepRecord:
    return StepRecord(rank, step, 0, loss=2.0 / step, weight_sum=1.0, correct=0.5, tokens=tokens, accept_len=2.5,
                      compute_s=1.0, data_wait_s=wait)


def test_bottleneck_names_the_side_that_holds_the_run_back() -> None:
    assert bottleneck(0.3, buffered=0, capacity=16) == "targets"
    assert bottleneck(0.0, buffered=12, capacity=16) == "drafters"
    assert bottleneck(0.05, buffered=4, capacity=16) == "balanced"


def test_rates_losses_and_the_line() -> None:
    clock = Clock()
    mon = RunMonitor(clock=clock)
    mon.add_pool(HSPool(PoolConfig(capacity=16, min_ready=4), 6).stats())
    mon.add_records([_rec(0, 1), _rec(1, 1, wait=1.0)])
    clock.t += 10
    mon.add_records([_rec(0, 2), _rec(1, 2)])
    assert (mon.loss_first, mon.loss_last, mon.step) == (2.0, 1.0, 2)
    assert mon.train_tok_s() == 400 / 10 and mon.replica_tok_s() == 400 / 5
    assert mon.data_wait_share() == 1.0 / 5
    line = mon.line()
    assert "step 2" in line and "q_hsb=[0, 0, 0, 0, 0, 0]" in line and "bottleneck: targets" in line


def test_progress_restarts_at_the_restored_step() -> None:
    clock = Clock()
    mon = RunMonitor(clock=clock)
    mon.add_records([_rec(0, 1199)])
    clock.t += 500
    mon.restart_at(1000)  # a rebuilt group redoes steps 1001..1199
    clock.t += 50
    mon.add_records([_rec(0, 1001)])
    assert mon.step == 1001 and clock() - mon.last_progress == 0



def test_target_rate_stays_positive_across_a_recreated_pool() -> None:
    """A recreated pool counts its targets' tokens from zero: the rate goes on, it does not turn negative."""
    from dataclasses import replace

    clock = Clock()
    mon = RunMonitor(clock=clock)
    base = HSPool(PoolConfig(capacity=16, min_ready=4), 6).stats()
    for tokens in (0, 1000, 2000, 100, 1100):  # 10 s apart; the pool was recreated before the 4th snapshot
        mon.add_pool(replace(base, tokens_by_target={0: tokens}))
        clock.t += 10
    # The 30 s window spans t=110..140: 1000 tokens, then 100 by the new pool, then 1000 more.
    assert mon.values()["target_tok_s"] == (1000 + 100 + 1000) / 30


def test_status_line_with_a_resumed_best_and_no_evaluation_yet() -> None:
    """A resumed run restores drafter-best/'s tau before this start has evaluated anything (chaos found
    the status line raising IndexError there)."""
    mon = RunMonitor(clock=Clock())
    mon.add_pool(HSPool(PoolConfig(capacity=16, min_ready=4), 6).stats())
    mon.add_records([_rec(0, 1)])
    mon.tau_best = (20, 3.25)  # what EvalRunner._resume sets from drafter-best/config.json
    assert "tau 3.25 (best 3.25 @20)" in mon.line()
    mon.add_tau(30, 2.5)
    assert "tau 2.50 (best 3.25 @20)" in mon.line()
