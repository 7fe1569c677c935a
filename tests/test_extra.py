"""The extra-GPU decision (app/run/elastic/extra.py), without Ray: advisor estimates, free resources and a clock in."""
from __future__ import annotations

import json

import pytest

from app.config.schema import TopologyConfig
from app.run.elastic.advisor import SplitAdvisor
from app.run.elastic.extra import ExtraPlanner, bundle_shape, side_gain
from app.run.topology import max_extra_actors

SHAPES = {"targets": {"CPU": 2.0, "GPU": 1.0}, "drafters": {"CPU": 4.0, "GPU": 1.0}}
ROOM = {"CPU": 8.0, "GPU": 2.0}


def _est(target_tok_s: float, drafter_tok_s: float, split=(2, 2)):
    """The advisor's estimate for these rates on `split` (the real SplitAdvisor, fed its inputs)."""
    adv = SplitAdvisor(*split)
    adv.rank_tokens = {r: drafter_tok_s for r in range(split[1])}
    adv.rank_compute_s = {r: 1.0 for r in range(split[1])}
    adv.target_tokens = {t: target_tok_s for t in range(split[0])}
    adv.target_forward_s = {t: 1.0 for t in range(split[0])}
    return adv.estimate(stable=True)


def _hold(p: ExtraPlanner, est, free=ROOM, split=(2, 2), start=0.0, **kw) -> list:
    return [a for t in range(6) for a in p.observe(start + t, est, split, free, SHAPES, **kw)]


def test_free_room_goes_to_the_short_targets_once_the_choice_holds() -> None:
    p = ExtraPlanner(max_extra_gpus=2, min_gain=0.15, hold_s=3.0)
    est = _est(100.0, 300.0)  # 2 targets make 200 tok/s, 2 ranks could train 600: targets short
    assert p.observe(0.0, est, (2, 2), ROOM, SHAPES) == []
    assert p.observe(2.5, est, (2, 2), ROOM, SHAPES) == []  # 2.5 s < hold_s
    (x,) = p.observe(3.0, est, (2, 2), ROOM, SHAPES)
    assert (x.side, x.old, x.new, x.shape, x.gpus) == ("targets", (2, 2), (3, 2), SHAPES["targets"], 1.0)
    assert x.gain_estimated == pytest.approx(0.5)  # min(300, 600) / min(200, 600) - 1
    assert p.observe(10.0, est, (2, 2), ROOM, SHAPES) == []  # one at a time
    p.done()
    assert p.summary()["extra_gpus"] == 1.0 and p.summary()["extra_bundles"] == 1


def test_short_drafters_get_the_bundle_only_past_rebalance_min_gain() -> None:
    p = ExtraPlanner(max_extra_gpus=4, min_gain=0.15, hold_s=3.0)
    (x,) = _hold(p, _est(300.0, 100.0))  # drafters short: 3 ranks train 300 vs 200 (+50%)
    assert (x.side, x.new) == ("drafters", (2, 3))
    p.done()
    # 8 targets vs 7 ranks, all at 60: one more rank makes 480 of 420 (+14%, under 0.15): none.
    assert _hold(p, _est(60.0, 60.0, split=(8, 7)), split=(8, 7), start=100.0) == []
    assert "not above 15%" in p.status()
    # The same +14% for a target is worth it: it costs no checkpoint (above the advisor's 5%).
    assert [x.side for x in _hold(p, _est(60.0, 60.0, split=(7, 8)), split=(7, 8), start=200.0)] == ["targets"]


def test_no_room_no_bundle_and_the_status_says_why() -> None:
    p = ExtraPlanner(max_extra_gpus=2, min_gain=0.15, hold_s=3.0)
    assert _hold(p, _est(100.0, 300.0), free={"CPU": 8.0, "GPU": 0.5}) == []
    assert "no room for a target bundle" in p.status()
    assert _hold(p, _est(100.0, 300.0), free=None) == []  # not probed yet


def test_the_cap_counts_gpus_and_failed_bundles_do_not_count() -> None:
    p = ExtraPlanner(max_extra_gpus=1, min_gain=0.15, hold_s=0.0)
    (x,) = _hold(p, _est(100.0, 300.0))
    p.failed("placement group not placed within 30 s")
    assert p.summary()["extra_gpus"] == 0 and p.history[-1]["failed"].startswith("placement group")
    (x,) = _hold(p, _est(100.0, 300.0), start=10.0)  # asked for again
    p.done()
    assert _hold(p, _est(100.0, 300.0, split=(3, 2)), split=(3, 2), start=20.0) == []
    assert "max_extra_gpus=1 reached" in p.status()


def test_blocked_balanced_or_off_takes_nothing() -> None:
    p = ExtraPlanner(max_extra_gpus=2, min_gain=0.15, hold_s=0.0)
    assert _hold(p, _est(100.0, 300.0), blocked=True) == []  # a re-split or a stop under way
    assert _hold(p, None) == []  # no estimate yet
    assert _hold(ExtraPlanner(2, 0.15, 0.0, mode="advise"), _est(100.0, 300.0)) == []
    assert _hold(ExtraPlanner(0, 0.15, 0.0), _est(100.0, 300.0)) == []
    assert side_gain((2, 2), "drafters", 100.0, 300.0) == 0.0  # the long side gains nothing


def test_shapes_and_pool_sizing_follow_the_topology() -> None:
    topo = TopologyConfig(num_targets=2, num_drafters=2, gpus_per_target=1, gpus_per_drafter=2, rebalance="auto",
                          max_extra_gpus=4)
    assert bundle_shape(topo, "drafters", use_gpu=True) == {"CPU": 4.0, "GPU": 2}
    assert bundle_shape(topo, "targets", use_gpu=False) == {"CPU": 2.0}
    assert max_extra_actors(topo) == 4
    assert max_extra_actors(TopologyConfig()) == 0


def test_max_extra_gpus_needs_rebalance_auto() -> None:
    with pytest.raises(ValueError, match="topology.max_extra_gpus=2 needs topology.rebalance=auto"):
        TopologyConfig(max_extra_gpus=2)
    with pytest.raises(ValueError, match="topology.max_extra_gpus"):
        TopologyConfig(max_extra_gpus=-1, rebalance="auto")


def test_an_extra_bundle_is_a_timeline_row_and_a_marked_event_in_the_report(tmp_path) -> None:
    from types import SimpleNamespace

    from app.run.outputs.report_page import write_report
    from app.run.outputs.timeline import Timeline, read_timeline

    clock = SimpleNamespace(t=1000.0)
    tl = Timeline(tmp_path, clock=lambda: clock.t)
    tl.start(SimpleNamespace(num_targets=2, num_drafters=2, gpus_per_target=1.0, gpus_per_drafter=1.0), "extra")
    clock.t += 30.0
    p = ExtraPlanner(max_extra_gpus=1, min_gain=0.15, hold_s=0.0)
    (x,) = _hold(p, _est(100.0, 300.0))
    tl.resplit_row("extra", **x.to_dict(), bundle=4)  # what ExtraGpus writes through RunMonitor.resplit_event
    tl.resplit_row("extra_done", number=1, side="targets", old=[2, 2], new=[3, 2], bundle=4, target_id=2, why=x.why)
    tl.close()
    rows = [r for r in read_timeline(tmp_path) if r["k"].startswith("extra")]
    assert [(r["k"], r["side"], r["new"]) for r in rows] == [("extra", "targets", [3, 2]),
                                                             ("extra_done", "targets", [3, 2])]
    p.done()
    (tmp_path / "summary.json").write_text(json.dumps(p.summary()))
    page = write_report(tmp_path).read_text()
    assert "extra target bundle: 2/2 -&gt; 3/2 targets/drafters" in page  # the events table (html-escaped)
    assert "<tr><th>extra_gpus</th><td>1</td></tr>" in page
