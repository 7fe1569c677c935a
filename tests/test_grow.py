"""The growth decision (app/run/elastic/grow.py), without Ray: probes of the lost bundles and a clock in, actions out."""
from __future__ import annotations

from app.run.elastic.grow import Grow, GrowthPlanner, ReturnTarget

DRAFTERS = [5, 6, 7]  # the topology's drafter bundles (targets 0-4 first)


def _settle(planner: GrowthPlanner, group: list[int], placed: set[int], start: float = 0.0, **kw) -> list[Grow]:
    """Observe every second for 12 s (past the 10 s settle time); the actions seen."""
    out: list[Grow] = []
    for t in range(13):
        out += planner.observe(start + t, group, DRAFTERS, placed, **kw)
    return out


def test_a_shrunk_group_grows_back_to_every_placed_bundle_once_the_set_settles() -> None:
    p = GrowthPlanner(settle_s=10.0)
    assert p.observe(0.0, [6], DRAFTERS, set()) == []  # nothing placed again: nothing to do
    assert p.observe(1.0, [6], DRAFTERS, {5, 7}) == []  # placed: the settle time starts
    assert p.observe(10.5, [6], DRAFTERS, {5, 7}) == []  # 9.5 s: not yet
    (g,) = p.observe(11.0, [6], DRAFTERS, {5, 7})
    assert (g.number, g.old, g.new, g.configured, g.bundles) == (1, 1, 3, 3, (5, 6, 7))
    assert "bundles [5, 7] lost with a node are placed again" in g.why
    assert p.observe(30.0, [6], DRAFTERS, {5, 7}) == []  # one at a time: pending until done
    p.done(3)
    assert p.observe(40.0, DRAFTERS, DRAFTERS, {5, 6, 7}) == []  # full size: nothing lost
    assert p.summary() == {"growths": 1, "growth_history": [{"k": "grow", **g.to_dict(), "done_size": 3}]}


def test_bundles_coming_back_one_after_another_give_one_growth_not_two() -> None:
    p = GrowthPlanner(settle_s=10.0)
    acts = [a for t in range(6) for a in p.observe(float(t), [6], DRAFTERS, {5})]
    acts += [a for t in range(6, 20) for a in p.observe(float(t), [6], DRAFTERS, {5, 7})]
    assert [(a.old, a.new, a.bundles) for a in acts] == [(1, 3, (5, 6, 7))]


def test_a_partial_return_grows_to_what_is_placed_and_says_what_is_still_missing() -> None:
    p = GrowthPlanner(settle_s=10.0)
    (g,) = _settle(p, [6], {5})
    assert (g.old, g.new, g.configured, g.bundles) == (1, 2, 3, (5, 6)) and "1 still without a node" in g.why


def test_no_growth_while_blocked_and_the_settle_time_restarts_after() -> None:
    p = GrowthPlanner(settle_s=10.0)
    assert _settle(p, [6], {5, 7}, blocked=True) == []  # a re-split or a stop under way
    assert p.observe(13.0, [6], DRAFTERS, {5, 7}) == []  # unblocked: settles afresh
    assert p.observe(22.0, [6], DRAFTERS, {5, 7}) == []
    assert len(p.observe(23.0, [6], DRAFTERS, {5, 7})) == 1


def test_a_failed_growth_is_recorded_and_asked_again_after_settling() -> None:
    p = GrowthPlanner(settle_s=10.0)
    assert len(_settle(p, [6], {5, 7})) == 1
    p.failed("the group rebuild failed")
    assert p.summary()["growths"] == 0 and p.history[-1]["failed"] == "the group rebuild failed"
    assert len(_settle(p, [6], {5, 7}, start=20.0)) == 1


def test_a_given_up_target_comes_back_only_after_its_bundle_was_seen_without_a_node() -> None:
    p = GrowthPlanner()
    # Target 3 gave up on a placed bundle (it kept crashing): never restarted by growth.
    assert p.targets({3: 3}, placed={3}, unplaced=set()) == []
    # Target 2's bundle had no node, then is placed again: it comes back, once.
    assert p.targets({2: 2, 3: 3}, placed={3}, unplaced={2}) == []
    assert p.targets({2: 2, 3: 3}, placed={2, 3}, unplaced=set()) == [
        ReturnTarget(2, 2, "target 2's bundle 2 is placed on a live node again")]
    assert p.targets({2: 2, 3: 3}, placed={2, 3}, unplaced=set()) == []


def test_a_growth_is_a_timeline_row_and_a_marked_event_in_the_report(tmp_path) -> None:
    from types import SimpleNamespace

    from app.run.outputs.report_page import write_report
    from app.run.outputs.timeline import Timeline, read_timeline

    clock = SimpleNamespace(t=1000.0)
    tl = Timeline(tmp_path, clock=lambda: clock.t)
    tl.start(SimpleNamespace(num_targets=5, num_drafters=3, gpus_per_target=1.0, gpus_per_drafter=1.0), "grow")
    clock.t += 30.0
    g = Grow(1, 1, 3, 3, (5, 6, 7), "bundles [5, 7] lost with a node are placed again")
    tl.resplit_row("grow", **g.to_dict())  # what Grower writes through RunMonitor.resplit_event
    tl.resplit_row("grow_done", number=1, old=1, new=3, configured=3, bundles=[5, 6, 7], why=g.why,
                   checkpoint="ckpt-00000008", requeued=2)
    tl.resplit_row("target_back", target_id=2, bundle=2, why="target 2's bundle 2 is placed on a live node again")
    tl.close()
    rows = [r for r in read_timeline(tmp_path) if r["k"].startswith("grow")]
    assert [(r["k"], r["old"], r["new"]) for r in rows] == [("grow", 1, 3), ("grow_done", 1, 3)]
    (tmp_path / "summary.json").write_text('{"growths": 1}')
    page = write_report(tmp_path).read_text()
    assert "drafter group grew 1 -&gt; 3 ranks (configured 3)" in page  # the events table (html-escaped)
    assert "<tr><th>growths</th><td>1</td></tr>" in page
    assert "target 2 starting again (its bundle 2 placed again)" in page
