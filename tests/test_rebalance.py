"""The split trigger (app/run/elastic/resplit.py) and the advisor's re-measuring after a re-split, without Ray."""
from __future__ import annotations

import pytest

from app.config.schema import TopologyConfig
from app.run.elastic.advisor import SplitAdvice, SplitAdvisor, best_split
from app.run.elastic.resplit import Rebalancer, Resplit, ResplitMeasured


def est(split: tuple[int, int], rt: float, rd: float) -> SplitAdvice:
    """The advisor's estimate for the current `split` at these per-side rates."""
    t, d, best, cur = best_split(split[0], split[1], rt, rd)
    return SplitAdvice(t, d, split[0], split[1], best / cur - 1, rt, rd, best, cur,
                       "targets" if split[0] * rt < split[1] * rd else "drafters", True)


def trigger(mode="auto", hold=10.0, gain=0.15, most=3, split=(5, 3)) -> Rebalancer:
    return Rebalancer(mode, hold, gain, most, *split, window_s=10.0)


def feed(rb: Rebalancer, split, rt, rd, t0: float, t1: float, dt: float = 1.0) -> list:
    out, t = [], t0
    while t <= t1:
        out += rb.observe(est(split, rt, rd), t)
        t += dt
    return out


def test_stable_advice_past_hold_asks_for_one_resplit_toward_the_short_side():
    rb = trigger()
    # Targets short: a target makes 100 tok/s, a drafter rank trains 400: 5/3 -> more targets.
    assert feed(rb, (5, 3), 100, 400, 0, 9) == []  # held 9 s < 10 s
    actions = feed(rb, (5, 3), 100, 400, 10, 30)
    assert len(actions) == 1 and isinstance(actions[0], Resplit)
    rs = actions[0]
    assert rs.old == (5, 3) and rs.new[0] > 5 and sum(rs.new) == 8 and rs.gain_estimated > 0.15
    assert rb.status().startswith("re-split to")


def test_drafters_short_moves_gpus_to_drafters():
    rb = trigger()
    (rs,) = feed(rb, (5, 3), 400, 100, 0, 20)
    assert rs.new[1] > 3 and sum(rs.new) == 8


@pytest.mark.parametrize("mode", ["off", "advise"])
def test_off_and_advise_never_act(mode):
    rb = trigger(mode)
    assert feed(rb, (5, 3), 100, 400, 0, 100) == []
    assert rb.shows_advice == (mode == "advise")


def test_gain_below_the_threshold_keeps_the_split():
    rb = trigger(gain=1.0)
    # 5/3 at 200/100: the best split (3/5) gains 67%, under the 100% asked for.
    e = est((5, 3), 200, 100)
    assert (e.targets, e.drafters) == (3, 5) and e.gain == pytest.approx(2 / 3)
    assert feed(rb, (5, 3), 200, 100, 0, 100) == []


def test_a_changing_advice_restarts_the_hold():
    rb = trigger()
    t, out = 0.0, []
    for i in range(40):  # the advice flips every 5 s between two splits: never stable for 10 s
        rates = (100, 400) if (i // 5) % 2 == 0 else (100, 250)
        out += rb.observe(est((5, 3), *rates), t)
        t += 1
    assert est((5, 3), 100, 400).targets != est((5, 3), 100, 250).targets
    assert out == []


def test_hysteresis_no_second_resplit_on_the_same_rates_and_at_most_max():
    rb = trigger(most=2)
    (rs,) = feed(rb, (5, 3), 100, 400, 0, 20)
    assert feed(rb, (5, 3), 100, 400, 21, 60) == []  # pending: one at a time
    rb.done(*rs.new, now=60, tokens=0)
    # Same rates on the new split: its advice is keep (best already), nothing happens.
    assert feed(rb, rs.new, 100, 400, 61, 200) == []
    # Noise that suggests another split but rates moved < 15%: still nothing.
    assert feed(rb, rs.new, 110, 380, 201, 300) == []
    # The balance really shifts (drafters 3x slower): a second re-split, back toward drafters.
    (rs2,) = feed(rb, rs.new, 100, 130, 301, 400)
    assert rs2.number == 2 and rs2.new[1] > rs.new[1]
    rb.done(*rs2.new, now=400, tokens=0)
    # The budget (2) is spent: whatever the rates do, no third.
    assert feed(rb, rs2.new, 100, 1000, 401, 500) == []
    assert rb.summary()["rebalances"] == 2


def test_refused_resplit_says_why_and_waits_for_the_rates_to_move():
    rb = trigger()
    (rs,) = feed(rb, (5, 3), 100, 400, 0, 20)
    rb.refused("target and drafter bundles differ in shape (GPU 2 vs 1)")
    assert "differ in shape" in rb.status()
    assert feed(rb, (5, 3), 100, 400, 21, 100) == []
    assert rb.history[-1]["refused"].startswith("target and drafter")


def test_measured_gain_compares_the_windows_before_and_after_and_can_show_a_loss():
    rb = trigger()
    tokens, out = 0.0, []
    for t in range(0, 21):  # 1000 tok/s before
        rb.tokens(tokens, t)
        out += rb.observe(est((5, 3), 100, 400), t)
        tokens += 1000
    (rs,) = out
    rb.done(*rs.new, now=25, tokens=tokens)
    measured = []
    for t in range(25, 40):  # 600 tok/s after: the re-split made things worse, and it says so
        measured += rb.tokens(tokens, t)
        tokens += 600
    (m,) = measured
    assert isinstance(m, ResplitMeasured)
    assert m.before_tok_s == pytest.approx(1000, rel=0.01)
    assert m.after_tok_s == pytest.approx(600, rel=0.01)
    assert m.gain_measured == pytest.approx(-0.4, abs=0.01)
    assert [h["k"] for h in rb.summary()["rebalance_history"]] == ["resplit", "resplit_measured"]


def test_bad_mode_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match="topology.rebalance='sometimes'"):
        Rebalancer("sometimes", 1, 0.1, 1, 5, 3)
    with pytest.raises(ValueError, match="topology.rebalance"):
        TopologyConfig(rebalance="sometimes")
    with pytest.raises(ValueError, match="topology.rebalance_min_gain"):
        TopologyConfig(rebalance_min_gain=-1)


def test_for_topology_reads_the_config_defaults():
    rb = Rebalancer.for_topology(TopologyConfig())
    assert (rb.mode, rb.hold_s, rb.min_gain, rb.max_rebalances, rb.split) == ("advise", 20.0, 0.15, 3, (5, 3))


def test_advisor_measures_afresh_after_a_resplit():
    clock = [0.0]
    adv = SplitAdvisor(5, 3, hold_s=0, clock=lambda: clock[0])
    for step in range(8):
        adv.add_records([{"rank": r, "tokens": 400, "compute_s": 1.0} for r in range(3)])
    adv.add_pool({"tokens_by_target": {t: 500 for t in range(5)}, "forward_s_by_target": {t: 5.0 for t in range(5)},
                  "done_by_target": {t: 5 for t in range(5)}})
    assert adv.rates() == (100.0, 400.0)
    adv.resplit(7, 1)
    assert adv.rates() == (0.0, 0.0) and not adv.enough_samples()
    assert adv.num_targets == 7
    # Targets 0-4 keep their counters; from now they make 200 tok/s; a new target 5 counts from zero.
    adv.add_pool({"tokens_by_target": {**{t: 900 for t in range(5)}, 5: 400},
                  "forward_s_by_target": {**{t: 7.0 for t in range(5)}, 5: 2.0},
                  "done_by_target": {**{t: 9 for t in range(5)}, 5: 4}})
    assert adv.rates()[0] == pytest.approx(200.0)


def test_pool_removes_a_retired_target_requeues_its_jobs_and_ignores_its_late_answers():
    from app.config.schema import PoolConfig
    from app.messages import ItemMeta, JobSpec
    from app.pool.stream import PoolControl
    from app.pool.hs_pool import HSPool

    pool = HSPool(PoolConfig(capacity=20, min_ready=1, jobs_in_flight_per_target=2), 1)
    pool.add_jobs(JobSpec(job_id=i, epoch=0, index=i, bucket=0, seq_indices=(i,), padded_tokens=64, est_bytes=100)
                  for i in range(6))
    c = PoolControl(pool)
    a, b = object(), object()
    c.add_target(0, a)
    c.add_target(1, b)
    held = [c.next_job(0, a).job_id, c.next_job(0, a).job_id]
    assert sorted(c.remove_target(0)) == sorted(held)  # back to the front of the queue
    assert c.next_job(0, a) is None and c.stats().targets == [1]
    assert [c.next_job(1, b).job_id, c.next_job(1, b).job_id] == held  # the next target gets them first
    # The retired target's late answer is stale (dropped), its death no failure.
    assert not pool.job_done(0, ItemMeta(held[0], 0, 1, 50, 40, 100, 0, 0.01), object())
    c.target_died(0, a, held[1], "RayActorError", "killed by the re-split")
    assert c.failures == [] and c.remove_target(0) == []
    c.request_stop()
    c.clear_stop()
    assert not c.stop_requested


def test_simulated_shifting_balance_auto_ends_within_10pct_of_the_best_fixed_split():
    """The real pool, step loop, advisor and trigger on a virtual clock (app/bench/feeding/resplit_sim.py): long
    sequences first (targets short), short later (drafters short). No fixed split suits both halves."""
    from app.bench.feeding.resplit_sim import compare, shifting_setup

    r = compare(shifting_setup(jobs=1200))
    assert r["auto_s"] <= 1.10 * r["best_fixed_s"], r
    assert 1 <= len(r["resplits"]) <= 2, r["resplits"]
    assert r["resplits"][0][1] == (5, 3) and r["resplits"][0][2][1] > 3  # toward the drafters, once short jobs come
    assert (r["trained_once"], r["trained_twice"], r["never_trained"]) == (1200, 0, 0)
    # 5/3 throughout (where auto starts) is slower than auto: the re-split paid.
    assert r["fixed_s"]["5/3"] > r["auto_s"]


def test_report_marks_each_resplit_on_the_time_axis_and_in_the_events_table():
    from app.run.outputs.report_page import render

    rows = [{"k": "run", "t": 0.0, "num_targets": 5, "num_drafters": 3},
            {"k": "resplit_done", "t": 5.0, "old": [5, 3], "new": [7, 1]}]
    assert "re-split 5/3 -&gt; 7/1 targets/drafters" in render(rows, {})


def test_advice_of_a_finished_run_starts_from_its_last_split():
    from app.advise import advise_from_timeline

    rows = [{"k": "run", "num_targets": 5, "num_drafters": 3}]
    rows += [{"k": "step", "rank": r, "tokens": 100, "compute_s": 1.0} for _ in range(8) for r in range(3)]
    rows.append({"k": "resplit_done", "old": [5, 3], "new": [7, 1]})
    rows += [{"k": "step", "rank": 0, "tokens": 800, "compute_s": 1.0} for _ in range(8)]
    rows.append({"k": "pool", "tokens_by_target": {str(t): 500 for t in range(7)},
                 "forward_s_by_target": {str(t): 5.0 for t in range(7)}, "done_by_target": {str(t): 5 for t in range(7)}})
    est = advise_from_timeline(rows)
    assert (est.current_targets, est.current_drafters) == (7, 1)
    assert est.drafter_tok_s == 800.0  # only the new group's steps


def test_a_bare_off_is_off_although_yaml_reads_it_as_a_boolean():
    from app.config.load import load_config

    cfg = load_config("conf/tiny.yaml", ["topology.rebalance=off"])
    assert cfg.topology.rebalance == "off"


def _drafter_rate_after_a_shift(half_life_s: float | None) -> float:
    """One rank: 20 steps at 100 tokens/s of compute, then 20 at 400, one step a second."""
    from types import SimpleNamespace

    clock = SimpleNamespace(t=0.0)
    adv = SplitAdvisor(1, 1, clock=lambda: clock.t, half_life_s=half_life_s)
    for rate in (100, 400):
        for _ in range(20):
            clock.t += 1.0
            adv.add_records([{"rank": 0, "tokens": rate, "compute_s": 1.0}])
    return adv.rates()[1]


def test_the_live_advisor_weighs_its_rates_by_recency_when_given_a_half_life(tmp_path) -> None:
    """topology.rebalance_half_life_s: the live path's advisor (the one a run's monitor is built with and feeds)
    gets the simulation's recency weights; 0 keeps the rates since the start (or the last re-split)."""
    from types import SimpleNamespace

    from app.config.load import load_config
    from app.run.elastic.planners import Planners
    from app.run.sweep import run_monitor

    for value, expected in (("0", None), ("5", 5.0)):
        cfg = load_config("conf/tiny.yaml", [f"checkpoint.dir={tmp_path / value}", f"topology.rebalance_half_life_s={value}"])
        monitor = run_monitor(SimpleNamespace(cfg=cfg, eval_prompts=[]), Planners.for_run(cfg))
        assert monitor.advisor.half_life_s == expected and monitor.listeners == [monitor.advisor]
    since_start, recent = _drafter_rate_after_a_shift(None), _drafter_rate_after_a_shift(5.0)
    assert since_start == pytest.approx(250, rel=0.05)  # (19 x 100 + 20 x 400) / 39 s: the past weighs half
    assert recent > 370  # 4 half-lives after the shift: the old rate hardly weighs (383 here)
    with pytest.raises(ValueError, match="topology.rebalance_half_life_s"):
        TopologyConfig(rebalance_half_life_s=-1)


def test_the_rebalance_bench_measures_each_split_in_injected_delay_seconds_and_can_show_a_loss(tmp_path):
    """`python -m app.bench rebalance`'s measure: the last half of the jobs of the step log's lineage, each step
    costing its injected delays (busiest rank x drafter delay, or jobs / targets x target delay): the same
    split gives the same figure at any load, a re-split the wrong way reads as a loss."""
    from app.bench.feeding.rebalance import virtual_rate
    from app.training.step_log import StepLog, lineage

    def log(name: str, first: int, then: int, at: int = 4) -> dict:
        path, job = tmp_path / name, iter(range(10_000))
        sl = StepLog(path)
        for s in range(1, 13):
            if s == at and then != first:  # the re-split: the new group starts from the checkpoint of step at - 1
                sl.group_start(at - 1)
            sl.step(s, [[next(job)] for _ in range(first if s < at else then)])
        return lineage(path)[0]

    off = virtual_rate(log("off", 3, 3), 8, 2.3, 2.0)
    assert off == (pytest.approx(3 / 2.0), 18)  # 5/3: the drafters bound it, 3 jobs per 2 s
    auto = virtual_rate(log("auto", 3, 4), 8, 2.3, 2.0)
    assert auto[0] == pytest.approx(4 / 2.3)  # 4/4: now the targets bound it, 4 jobs per 2.3 s
    wrong = virtual_rate(log("wrong", 3, 2), 8, 2.3, 2.0)  # 6/2: the short side made shorter
    assert wrong[0] == pytest.approx(2 / 2.0) and wrong[0] < off[0]
    late = virtual_rate(log("late", 3, 4, at=10), 8, 2.3, 2.0)  # the window's first 2 steps still at 5/3
    assert off[0] < late[0] < auto[0]
    # Steps rolled back by a group start are not in the lineage: they cost nothing here.
    path = tmp_path / "rolled"
    sl = StepLog(path)
    for s in range(1, 9):
        sl.step(s, [[10 * s + r] for r in range(3)])
    sl.group_start(6)
    for s in range(7, 13):
        sl.step(s, [[10 * s + r] for r in range(3)])
    assert virtual_rate(lineage(path)[0], 8, 2.3, 2.0) == (pytest.approx(1.5), 18)
    # A job trained twice in the lineage costs its micro-batch twice but counts once: a loss.
    twice = lineage(path)[0] | {13: [[120], [121], [122]]}
    assert virtual_rate(twice, 8, 2.3, 2.0)[0] < 1.5
    # The end of the data leaves steps with idle ranks; where they fall does not move the figure.
    tail = {s: [[3 * s], [3 * s + 1], [3 * s + 2]] for s in range(1, 11)} | {11: [[40], [], []], 12: [[], [41], []]}
    assert virtual_rate(tail, 8, 2.3, 2.0, share=0.4)[0] == pytest.approx(1.5)


def test_the_rebalance_benchs_setting_leaves_the_advisor_one_answer_while_the_sides_compute_is_within_0_9_s(tmp_path):
    """Issue 45: the auto run's one wall-clock input is the advisor's choice on measured rates (injected delay
    plus the tiny model's compute, which load stretches). In the bench's setting that choice is 4/4 from either
    start, its estimated gain past rebalance_min_gain while either side's compute exceeds the other's by
    under 0.9 s a job (0.2 s on each, and about 1.3 s against 0.9 s, were measured), and the re-split it makes is
    worth 4/3 >= the goal in injected-delay seconds. Beyond that band (two CPU busy loops beside the bench made
    a drafter micro-batch's compute ~12.6 s against 2.1 s) the advisor answers otherwise: docs/benchmarks.md."""
    from app.bench.feeding.rebalance import GOAL, SIDES, WINDOW, virtual_rate
    from app.training.step_log import StepLog, lineage

    min_gain = TopologyConfig().rebalance_min_gain
    for side in SIDES.values():
        for more_extra, short_extra in ((0, 0), (0.2, 0.2), (0.9, 0), (0, 0.9), (1.25, 0.9), (0.9, 1.25), (3, 2.5)):
            more_is_targets = side.targets > side.drafters
            target_extra, drafter_extra = (more_extra, short_extra) if more_is_targets else (short_extra, more_extra)
            t_rate, d_rate = 1 / (side.target_delay_s + target_extra), 1 / (side.drafter_delay_s + drafter_extra)
            t, d, best, now = best_split(side.targets, side.drafters, t_rate, d_rate)
            assert (t, d) == (4, 4) and best / now - 1 > min_gain, (side, target_extra, drafter_extra)
        t, d, best, now = best_split(side.targets, side.drafters, 1 / side.target_delay_s, 1 / side.drafter_delay_s)
        assert best / now == pytest.approx(4 / 3)

    def rate(side, name: str, ranks_after: int) -> float:  # 40 steps, a re-split after 8 of them
        sl, job = StepLog(tmp_path / name), iter(range(1000))
        for s in range(1, 41):
            sl.step(s, [[next(job)] for _ in range(side.drafters if s <= 8 else ranks_after)])
        return virtual_rate(lineage(tmp_path / name)[0], 8, side.target_delay_s, side.drafter_delay_s, WINDOW)[0]

    for name, side in SIDES.items():
        ratio = rate(side, f"auto-{name}", 4) / rate(side, f"off-{name}", side.drafters)
        assert ratio == pytest.approx(4 / 3) and ratio >= GOAL


def test_the_virtual_clock_charges_the_injected_delays_so_a_busy_boxs_starved_drafters_still_get_4_4(tmp_path):
    """Issue 45: beside two CPU busy loops the bench's drafter micro-batch measured ~12.6 s of compute on top of its
    4.0 s delay, a target forward 2.1 s on top of 3.7 s; the measured advice was 2/6, the wrong way for the delays
    the bench's measure charges. faults.virtual_clock charges the delays instead: 4/4 at +33%, whatever the load."""
    from app.bench.feeding.rebalance import COMMON, SIDES
    from app.config.errors import ConfigError
    from app.config.load import load_config

    def advice(costs, target_tokens_per_job=600):
        adv = SplitAdvisor(5, 3, hold_s=0.0, costs=costs)
        for step in range(8):  # one job (micro-batch) per rank per step, 600 tokens each, the all-reduce starved
            adv.add_records([{"rank": r, "tokens": 600, "compute_s": 4.0 + 12.6, "job_ids": (10 * step + r,)}
                             for r in range(3)])
        adv.add_pool({"tokens_by_target": {t: 6 * target_tokens_per_job for t in range(5)},
                      "done_by_target": {t: 6 for t in range(5)},
                      "forward_s_by_target": {t: 6 * (3.7 + 2.1) for t in range(5)}})
        assert adv.enough_samples()
        est = adv.estimate()
        return (est.targets, est.drafters), est.gain, est.target_tok_s / est.drafter_tok_s

    assert advice(None)[0] == (2, 6)  # what the busy-loop run did: measured rates, the scheduler's verdict
    # The targets' jobs so far shorter than the ranks' (they run ahead by the buffer; the bench's first auto run
    # asked at a rate ratio of 0.93, +24%): one tokens-per-job figure for both sides, so the delays alone decide.
    for target_tokens in (600, 500):
        split, gain, ratio = advice((3.7, 4.0), target_tokens)
        assert split == (4, 4) and gain == pytest.approx(1 / 3) and ratio == pytest.approx(4.0 / 3.7)
    # The bench turns it on with both delays set; the live run's advisor takes them as its costs.
    side = SIDES["drafters"]
    cfg = load_config("conf/tiny.yaml", [*COMMON, *side.overrides(), f"checkpoint.dir={tmp_path}"])
    assert SplitAdvisor.for_run(cfg).costs == (side.target_delay_s, side.drafter_delay_s)
    assert SplitAdvisor.for_run(load_config("conf/tiny.yaml", [f"checkpoint.dir={tmp_path}"])).costs is None
    with pytest.raises(ConfigError, match=r"faults.virtual_clock=True charges each side its injected delay"):
        load_config("conf/tiny.yaml", ["faults.virtual_clock=true", "faults.target_delay_s=3.7"])


def test_the_rebalance_benchs_busy_loops_run_from_the_drafters_start_to_the_runs_end(tmp_path):
    import time

    from app.bench.feeding.rebalance import busy_loops

    started = tmp_path / "steps.jsonl"
    with busy_loops(2, started, poll_s=0.05) as procs:
        time.sleep(0.2)
        assert procs == []  # none before the drafter group is up
        started.touch()
        time.sleep(0.3)
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.poll() is not None for p in procs)  # gone with the run
    with busy_loops(0, started) as procs:
        assert procs == []


def test_the_rebalance_bench_says_where_the_resplit_landed_in_jobs():
    from app.bench.feeding.rebalance import first_new_split_job

    steps = {1: [[0], [1], [2]], 2: [[3], [4], [5]], 3: [[6], [7], [8], [9]], 4: [[10], [11], [12], [13]]}
    assert first_new_split_job(steps) == 6
    assert first_new_split_job({s: v for s, v in steps.items() if s < 3}) is None
