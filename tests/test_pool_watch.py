"""What the supervisor reads from a pool snapshot (app/run/supervise/pool_watch.py), without Ray: each
target failure and quarantined job reported once, the failure count started again for a recreated pool,
the policy's tick and its servable rule, and the ledger's counts for summary.json."""
from __future__ import annotations

from types import SimpleNamespace

from app.messages import TargetFailure
from app.run.supervise.events import RankProgress, TargetFailed, Tick
from app.run.supervise.pool_watch import PoolWatch, ledger_report


def snapshot(failures=(), quarantined=None, buffered=0, producing_finished=False, ages=None):
    return SimpleNamespace(target_failures=list(failures), quarantined=dict(quarantined or {}), buffered=buffered,
                           producing_finished=producing_finished, oldest_in_flight_age_s=dict(ages or {}),
                           total_jobs=40, acked=7, acked_twice=1)


def test_each_target_failure_is_reported_once_and_a_new_pool_starts_its_count_again():
    watch = PoolWatch(min_ready=2)
    one, two = TargetFailure(0, 11, "RayActorError: died"), TargetFailure(1, 12, "RayActorError: died")
    assert list(watch.new_failures(snapshot([one]))) == [TargetFailed(0, str(one))]
    assert list(watch.new_failures(snapshot([one, two]))) == [TargetFailed(1, str(two))]
    assert list(watch.new_failures(snapshot([one, two]))) == []
    watch.new_pool()  # the recreated pool lists its own failures from the start
    assert list(watch.new_failures(snapshot([two]))) == [TargetFailed(1, str(two))]


def test_each_quarantined_job_is_reported_once_in_job_order():
    watch = PoolWatch(min_ready=2)
    assert watch.new_quarantined(snapshot(quarantined={9: "boom", 3: "bang"})) == [(3, "bang"), (9, "boom")]
    assert watch.new_quarantined(snapshot(quarantined={9: "boom", 3: "bang", 5: "oops"})) == [(5, "oops")]
    watch.new_pool()  # quarantines stay reported across a recreated pool
    assert watch.new_quarantined(snapshot(quarantined={3: "bang"})) == []


def test_the_tick_is_servable_with_min_ready_items_or_any_once_production_finished():
    watch = PoolWatch(min_ready=2)
    ranks = (RankProgress(0, "compute", 1.5, 4),)
    tick = watch.tick(snapshot(buffered=2, ages={0: 3.0}, quarantined={1: "x"}), steps=4, ranks=ranks)
    assert tick == Tick({0: 3.0}, True, 4, ranks, quarantined=1, total_jobs=40)
    assert not watch.tick(snapshot(buffered=1), 4, ()).servable
    assert watch.tick(snapshot(buffered=1, producing_finished=True), 4, ()).servable
    assert not watch.tick(snapshot(buffered=0, producing_finished=True), 4, ()).servable


def test_the_ledger_report_counts_acks_and_lists_quarantined_jobs():
    assert ledger_report(snapshot(quarantined={5: "e5", 2: "e2"})) == {
        "jobs_acked": 7, "jobs_acked_twice": 1, "jobs_total": 40, "jobs_quarantined": 2,
        "quarantined_jobs": [{"job_id": 2, "error": "e2"}, {"job_id": 5, "error": "e5"}]}
