"""Split advisor on synthetic measurements, the timeline it reads, and `python -m app.advise`."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.advise import advise_from_timeline, main as advise_main
from app.messages import StepRecord
from app.run.elastic.advisor import MIN_STEPS_PER_RANK, WARMUP_STEPS, SplitAdvisor, best_split
from app.run.outputs.timeline import Timeline, read_timeline


def _pool(tokens: dict[int, int], forward_s: dict[int, float], jobs: int = 10):
    return SimpleNamespace(tokens_by_target=tokens, forward_s_by_target=forward_s,
                           done_by_target={t: jobs for t in tokens}, q_hsb=[0, 1], buffered=1, capacity_items=16,
                           pool_bytes=0, pending=0, in_flight=0, leased=0, acked=0, total_jobs=0, targets=list(tokens), restarts={})


def _feed(advisor: SplitAdvisor, targets: int, drafters: int, target_tok_s: float, drafter_tok_s: float,
          steps: int = 20) -> None:
    """Each rank trains 100 tokens per step at `drafter_tok_s`; each target forwards at `target_tok_s`."""
    for step in range(1, steps + 1):
        advisor.add_records([StepRecord(rank=r, step=step, epoch=0, loss=1.0, weight_sum=1.0, correct=0.5,
                                        tokens=100, accept_len=1.0, compute_s=100 / drafter_tok_s)
                             for r in range(drafters)])
    advisor.add_pool(_pool({t: int(target_tok_s * 10) for t in range(targets)}, {t: 10.0 for t in range(targets)}))


@pytest.mark.parametrize("targets,drafters,want", [(1, 7, (4, 4)), (7, 1, (4, 4))])
def test_equal_rates_move_gpus_to_the_slow_side(targets, drafters, want):
    clock = SimpleNamespace(t=0.0)
    advisor = SplitAdvisor(targets, drafters, hold_s=0.0, clock=lambda: clock.t)
    _feed(advisor, targets, drafters, 1000.0, 1000.0)
    advice = advisor.advice()
    assert advice is not None and (advice.targets, advice.drafters) == want
    assert advice.target_tok_s == pytest.approx(1000.0) and advice.drafter_tok_s == pytest.approx(1000.0)
    # 1/7 (and 7/1): 1 x 1000 = 1000 tok/s now; 4/4: 4000 -> +300%
    assert advice.gain == pytest.approx(3.0)
    assert advice.text() == "advice: 4 targets / 4 drafters (+300% tokens/s)"


def test_five_three_at_equal_rates_goes_four_four():
    advisor = SplitAdvisor(5, 3, hold_s=0.0)
    _feed(advisor, 5, 3, 1000.0, 1000.0)
    advice = advisor.advice()
    assert (advice.targets, advice.drafters) == (4, 4) and advice.gain == pytest.approx(4000 / 3000 - 1)
    assert advice.bound_now == "drafters"


def test_fast_targets_get_fewer_gpus():
    # A target makes 3x what a rank trains: 2 targets feed 6 ranks (6000 tok/s) vs 3000 at 5/3.
    t, d, best, current = best_split(5, 3, 3000.0, 1000.0)
    assert (t, d, best, current) == (2, 6, 6000.0, 3000.0)


def test_small_gain_keeps_the_split():
    # 4/4 at target 1000, drafter 1020: 4000 now; 3/5 gives min(3000, 5100): worse; keep.
    t, d, best, current = best_split(4, 4, 1000.0, 1020.0)
    assert (t, d) == (4, 4) and best == current
    advisor = SplitAdvisor(4, 4, hold_s=0.0)
    _feed(advisor, 4, 4, 1000.0, 1020.0)
    assert advisor.advice().text() == "advice: keep 4 targets / 4 drafters"


def test_two_gpu_targets_count_gpus_not_actors():
    # 1 target x 2 GPUs + 6 drafters = 8 GPUs; a target 3000 tok/s, a rank 1000: 3000 now; 2 targets
    # take 4 GPUs, leaving 4 ranks: min(6000, 4000) = 4000 (+33%); 3 targets leave 2 ranks: 2000.
    t, d, best, current = best_split(1, 6, 3000.0, 1000.0, gpus_per_target=2.0, gpus_per_drafter=1.0)
    assert (t, d, best, current) == (2, 4, 4000.0, 3000.0)


def test_advice_waits_for_samples_and_a_steady_split():
    clock = SimpleNamespace(t=0.0)
    advisor = SplitAdvisor(1, 7, hold_s=20.0, clock=lambda: clock.t)
    _feed(advisor, 1, 7, 1000.0, 1000.0, steps=MIN_STEPS_PER_RANK + WARMUP_STEPS - 1)
    assert advisor.estimate() is not None and advisor.advice() is None  # too few steps per rank
    _feed(advisor, 1, 7, 1000.0, 1000.0, steps=1)
    assert advisor.advice() is None  # enough samples, but the split was only just seen
    clock.t = 25.0
    advisor.add_pool(_pool({0: 10000}, {0: 10.0}))
    assert advisor.advice() is not None and advisor.advice().targets == 4


def test_warmup_step_is_left_out_of_the_drafter_rate():
    advisor = SplitAdvisor(1, 1, hold_s=0.0)
    slow = StepRecord(rank=0, step=1, epoch=0, loss=1, weight_sum=1, correct=0, tokens=100, accept_len=1,
                      compute_s=50.0)  # first step: compile, allocate
    fast = [StepRecord(rank=0, step=s, epoch=0, loss=1, weight_sum=1, correct=0, tokens=100, accept_len=1,
                       compute_s=0.1) for s in range(2, 12)]
    advisor.add_records([slow, *fast])
    assert advisor.rates()[1] == pytest.approx(1000.0)


def test_timeline_round_trip_and_cli(tmp_path, capsys):
    topo = SimpleNamespace(num_targets=1, num_drafters=7, gpus_per_target=1.0, gpus_per_drafter=1.0)
    tl = Timeline(tmp_path, pool_every_s=0.0)
    tl.start(topo, "t")
    for step in range(1, 12):
        tl.add_records([StepRecord(rank=r, step=step, epoch=0, loss=2.0, weight_sum=1, correct=0.1, tokens=100,
                                   accept_len=1.2, per_pos_acc=[0.3, 0.1], compute_s=0.1) for r in range(7)])
        tl.add_pool(_pool({0: 1000 * step}, {0: 1.0 * step}, jobs=step))
    tl.note("target 0 job 3: boom -> restarted")
    tl.close()
    with open(tmp_path / "timeline.jsonl", "a") as f:
        f.write('{"k": "step", "rank"')  # a driver killed mid-line
    rows = read_timeline(tmp_path)
    assert [r["k"] for r in rows].count("step") == 77 and rows[-1]["k"] == "event"
    advice = advise_from_timeline(rows)
    assert (advice.targets, advice.drafters) == (4, 4) and advice.stable
    assert advise_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "advice: 4 targets / 4 drafters (+300% tokens/s)" in out
    assert "RESULT targets=4 drafters=4 gain=3.000" in out


def test_resumed_run_adds_each_starts_target_counters(tmp_path):
    topo = SimpleNamespace(num_targets=7, num_drafters=1, gpus_per_target=1.0, gpus_per_drafter=1.0)
    tl = Timeline(tmp_path, pool_every_s=0.0)
    for start in range(2):  # each start has a fresh pool whose counters begin at zero
        tl.start(topo, "t", resumed_step=10 * start)
        tl.add_records([StepRecord(rank=0, step=s, epoch=0, loss=1, weight_sum=1, correct=0, tokens=1000,
                                   accept_len=1, compute_s=1.0) for s in range(1, 11)])
        tl.add_pool(_pool({t: 500 + 1000 * start for t in range(7)}, {t: 1.0 for t in range(7)}, jobs=5))
    tl.close()
    advice = advise_from_timeline(read_timeline(tmp_path))
    # 2000 tokens over 2 s = 1000 tok/s per target (the last start alone would say 1500), 1000 per rank:
    # 7/1 gives 1000 tok/s, 4/4 gives 4000.
    assert advice.target_tok_s == pytest.approx(1000.0) and advice.drafter_tok_s == pytest.approx(1000.0)
    assert (advice.targets, advice.drafters) == (4, 4) and advice.gain == pytest.approx(3.0)
    # app.advise streams the file (a generator read once, the last header passed in): the same advice.
    from app.run.outputs.timeline import iter_timeline

    *_, header = iter_timeline(tmp_path, kinds=("run",))
    streamed = advise_from_timeline(iter_timeline(tmp_path, kinds=("run", "pool", "step", "resplit_done")), header)
    assert streamed == advice


def test_cli_without_a_timeline_exits_2(tmp_path, capsys):
    assert advise_main([str(tmp_path)]) == 2
    assert "no timeline.jsonl" in capsys.readouterr().err


def test_status_line_carries_advice_and_tau_once_stable(tmp_path):
    from app.run.outputs.monitor import RunMonitor

    clock = SimpleNamespace(t=0.0)
    mon = RunMonitor(clock=lambda: clock.t)
    mon.advisor = SplitAdvisor(1, 7, hold_s=10.0, clock=lambda: clock.t)
    timeline = Timeline(tmp_path, pool_every_s=0.0)
    mon.listeners += [mon.advisor, timeline]
    recs = [StepRecord(rank=r, step=s, epoch=0, loss=1.0, weight_sum=1.0, correct=0.5, tokens=100, accept_len=1.0,
                       compute_s=0.1) for s in range(1, 10) for r in range(7)]
    mon.add_records(recs)
    mon.add_pool(_pool({0: 10000}, {0: 10.0}))
    assert "advice" not in mon.line()  # the split was only just seen
    clock.t = 11.0
    mon.add_pool(_pool({0: 11000}, {0: 11.0}))
    assert "| bottleneck: balanced (advice: 4 targets / 4 drafters (+300% tokens/s))" in mon.line()
    assert mon.add_tau(20, 2.5) and not mon.add_tau(40, 2.4) and mon.add_tau(60, 3.1)
    assert "tau 3.10 (best 3.10 @60)" in mon.line() and mon.values()["tau_best"] == 3.1
    assert mon.split_advice()["text"] == "advice: 4 targets / 4 drafters (+300% tokens/s)"
    mon.note("target 0 crashed -> restarted")
    timeline.close()
    kinds = [r["k"] for r in read_timeline(tmp_path)]
    assert kinds.count("step") == 63 and kinds.count("pool") == 2 and kinds[-1] == "event"
