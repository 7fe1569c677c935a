"""The supervision policy without Ray, its two halves (the stream's targets, a run's drafters): events and a clock
in, actions out; the pool client's retries."""
from __future__ import annotations

import pytest

from app.config.run_sections import SupervisionConfig
from app.run.supervise.events import (DrafterGroupFailed, DrafterGroupStarted, Fail, GiveUpTarget, KillStalledTarget, RankProgress, RebuildDrafters, RequestStop, RestartTarget, StopSignal, TargetFailed, TargetStartFailed, TargetStarted, Tick)
from app.run.supervise.policy import DrafterPolicy, TargetPolicy
from app.messages import DrafterPhase


def _cfg(**kw) -> SupervisionConfig:
    return SupervisionConfig(**{"max_restarts_target": 2, "max_restarts_drafter_group": 1, "stall_timeout_s": 60.0,
                                "stop_timeout_s": 30.0, **kw})


def _policy(num_targets: int = 2, **kw) -> TargetPolicy:
    """The stream's half, every target started."""
    p = TargetPolicy(_cfg(**kw), num_targets, now=0.0)
    for t in range(num_targets):
        assert p.on(TargetStarted(t), 0.0) == []
    return p


def _drafters(**kw) -> DrafterPolicy:
    """A run's half, its group started at step 0."""
    p = DrafterPolicy(_cfg(**kw), now=0.0)
    assert p.on(DrafterGroupStarted(0), 0.0) == []
    return p


def _tick(servable=False, steps=0, ages=None, ranks=()) -> Tick:
    return Tick(ages or {}, servable, steps, tuple(ranks))


def test_restart_within_budget_then_give_up_when_spent() -> None:
    p = _policy(max_restarts_target=2)
    assert p.on(TargetFailed(0, "boom"), 1.0) == [RestartTarget(0, 1, 2, "boom")]
    assert p.alive() == [1]  # restarting, not alive until it answers
    p.on(TargetStarted(0), 2.0)
    assert p.on(TargetFailed(0, "boom"), 3.0) == [RestartTarget(0, 2, 2, "boom")]
    p.on(TargetStarted(0), 4.0)
    actions = p.on(TargetFailed(0, "boom"), 5.0)
    assert actions == [GiveUpTarget(0, 2, 2, 1, "boom")]
    assert p.alive() == [1] and p.restarts() == {"target": 2, "pool": 0}
    assert p.on(TargetFailed(0, "late report"), 6.0) == []  # a given-up target is not counted again


def test_zero_budget_fails_fast_naming_the_setting() -> None:
    p = _policy(max_restarts_target=0)
    [action] = p.on(TargetFailed(1, "RayActorError"), 1.0)
    assert isinstance(action, Fail)
    assert "TargetActor 1" in action.message and "supervision.max_restarts_target=0" in action.message


def test_a_replacement_that_cannot_start_counts_against_the_budget_and_the_run_goes_on() -> None:
    p = _policy(max_restarts_target=1)
    assert p.on(TargetFailed(0, "crash"), 1.0) == [RestartTarget(0, 1, 1, "crash")]
    actions = p.on(TargetStartFailed(0, "CUDA error: no device"), 2.0)
    assert actions == [GiveUpTarget(0, 1, 1, 1, "CUDA error: no device")]  # target 1 still alive: no Fail
    assert p.alive() == [1]


def test_fail_when_no_target_is_left() -> None:
    p = _policy(num_targets=2, max_restarts_target=1)
    p.on(TargetFailed(0, "a"), 1.0)
    p.on(TargetFailed(1, "b"), 1.0)
    assert p.on(TargetStartFailed(0, "dead gpu"), 2.0) == [GiveUpTarget(0, 1, 1, 0, "dead gpu")]
    actions = p.on(TargetStartFailed(1, "node gone"), 3.0)
    assert isinstance(actions[0], GiveUpTarget) and isinstance(actions[1], Fail)
    assert "no target left" in actions[1].message and "node gone" in actions[1].message


def test_a_target_restarting_keeps_the_run_alive() -> None:
    p = _policy(num_targets=1, max_restarts_target=3)
    assert p.on(TargetFailed(0, "a"), 1.0) == [RestartTarget(0, 1, 3, "a")]
    assert p.alive() == []  # none alive, but one is loading: no Fail
    assert p.on(_tick(), 500.0) == [] and _drafters().on(_tick(), 500.0) == []


def test_drafter_group_rebuild_within_budget_then_fail() -> None:
    p = _drafters(max_restarts_drafter_group=1)
    assert p.on(DrafterGroupFailed("rank 1 died"), 10.0) == [RebuildDrafters("rank 1 died", 1, 1)]
    p.on(DrafterGroupStarted(4), 20.0)
    [action] = p.on(DrafterGroupFailed("rank 0 died"), 30.0)
    assert isinstance(action, Fail) and "max_restarts_drafter_group" in action.message and "(1/1)" in action.message


def test_stalled_target_is_killed_once() -> None:
    p = _policy(stall_timeout_s=60.0)
    assert p.on(_tick(ages={0: 59.0, 1: 10.0}), 59.0) == []
    assert p.on(_tick(ages={0: 61.0, 1: 10.0}), 61.0) == [KillStalledTarget(0, 61.0)]
    assert p.on(_tick(ages={0: 62.0}), 62.0) == []  # killed, waiting for the pool's failure report
    assert p.on(TargetFailed(0, "killed"), 63.0) == [RestartTarget(0, 1, 2, "killed")]


def test_drafters_stalled_with_data_waiting() -> None:
    p = _drafters(stall_timeout_s=60.0)
    assert p.on(_tick(servable=True, steps=3), 30.0) == []  # a step: progress at t=30
    assert p.on(_tick(servable=True, steps=3), 89.0) == []
    [action] = p.on(_tick(servable=True, steps=3), 91.0)
    assert isinstance(action, RebuildDrafters) and "no step for 61 s" in action.reason


def test_starving_drafters_are_not_stalled() -> None:
    """A rank waiting for a pull with nothing buffered: the targets are slow, not the drafters."""
    p = _drafters(stall_timeout_s=60.0)
    ranks = [RankProgress(0, DrafterPhase.WAIT_DATA, 100.0), RankProgress(1, DrafterPhase.COLLECTIVE, 100.0)]
    assert p.on(_tick(servable=False, ranks=ranks), 100.0) == []
    assert p.on(_tick(servable=False), 200.0) == []  # without progress reports only the servable rule judges


def test_rank_stuck_outside_a_collective_on_the_last_step_is_stalled() -> None:
    """Nothing buffered (the stream is over) and one rank computing forever while the others wait in
    the all-reduce: no rank waits for data, so this is a stall."""
    p = _drafters(stall_timeout_s=60.0)
    ranks = [RankProgress(0, DrafterPhase.COLLECTIVE, 70.0), RankProgress(1, DrafterPhase.COMPUTE, 70.0)]
    [action] = p.on(_tick(servable=False, ranks=ranks), 70.0)
    assert isinstance(action, RebuildDrafters) and "rank 1 compute" in action.reason


def test_unresponsive_rank_with_a_byte_full_pool_is_stalled() -> None:
    """A byte-full pool buffers nothing (leases hold the bytes); a rank that stopped answering never
    frees them."""
    p = _drafters(stall_timeout_s=60.0)
    ranks = [RankProgress(0, DrafterPhase.UNRESPONSIVE, 65.0), RankProgress(1, DrafterPhase.COLLECTIVE, 65.0)]
    [action] = p.on(_tick(servable=False, ranks=ranks), 65.0)
    assert isinstance(action, RebuildDrafters)


def test_finished_group_is_not_stalled() -> None:
    p = _drafters(stall_timeout_s=60.0)
    ranks = [RankProgress(0, DrafterPhase.DONE, 90.0), RankProgress(1, DrafterPhase.DONE, 90.0)]
    assert p.on(_tick(ranks=ranks), 90.0) == []


def test_a_rebuilt_group_gets_a_full_timeout() -> None:
    p = _drafters(stall_timeout_s=60.0, max_restarts_drafter_group=2)
    assert isinstance(p.on(_tick(servable=True), 61.0)[0], RebuildDrafters)
    p.on(DrafterGroupStarted(0), 80.0)
    assert p.on(_tick(servable=True), 139.0) == []
    assert isinstance(p.on(_tick(servable=True), 141.0)[0], RebuildDrafters)


def test_stop_once_then_fail_past_the_timeout() -> None:
    p = _drafters(stop_timeout_s=30.0)
    assert p.on(StopSignal(), 10.0) == [RequestStop(30.0)]
    assert p.on(StopSignal(), 11.0) == []  # asked once
    assert p.on(_tick(steps=1), 39.0) == []
    [action] = p.on(_tick(steps=1), 41.0)
    assert isinstance(action, Fail) and "supervision.stop_timeout_s=30" in action.message


# ---- the pool client: retries and a dead pool, driven without a cluster ---------------------------

class _Handle:
    """An actor handle whose `method.remote(*args)` returns the call itself (a stand-in object ref)."""

    def __getattr__(self, name):
        return type("M", (), {"remote": staticmethod(lambda *args: (name, args))})


def _client(tmp_path, failures: list[BaseException]):
    """A PoolClient whose calls raise `failures` in turn, then answer; returns it and the pauses it took."""
    from app.run.supervise.pool_client import PoolClient

    pauses: list[float] = []

    def get(ref, timeout):
        assert timeout == 60.0
        if failures:
            raise failures.pop(0)
        return ref

    return PoolClient(_Handle(), str(tmp_path), get=get, sleep=pauses.append), pauses


def _unavailable():
    from ray.exceptions import ActorUnavailableError

    return ActorUnavailableError("connection blip", None)


def test_an_idempotent_pool_call_is_retried_with_a_doubling_pause(tmp_path) -> None:
    client, pauses = _client(tmp_path, [_unavailable(), _unavailable()])
    assert client.set_ranks(2) == ("set_ranks", (2,))
    assert pauses == [0.5, 1.0]


def test_a_pool_that_stays_unavailable_ends_the_run_after_the_retries(tmp_path) -> None:
    from app.run.supervise.events import RunFailed

    client, pauses = _client(tmp_path, [_unavailable() for _ in range(6)])
    with pytest.raises(RunFailed) as info:
        client.stats()
    assert pauses == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert str(info.value) == ("pool actor HSPoolActor died (ActorUnavailableError); the run stops here. Resubmit "
                               "the same command to resume from the start (no checkpoint yet)")


def test_a_call_that_is_unsafe_twice_is_never_retried_and_a_dead_pool_is_one_line(tmp_path) -> None:
    from ray.exceptions import ActorDiedError

    from app.run.supervise.events import RunFailed

    client, pauses = _client(tmp_path, [_unavailable()])
    with pytest.raises(RunFailed, match=r"^pool actor HSPoolActor died \(ActorUnavailableError\)"):
        client.rollback([1, 2])  # it may have run: re-sending could roll back twice
    client, pauses = _client(tmp_path, [ActorDiedError()])
    with pytest.raises(RunFailed) as info:
        client.stats()
    assert pauses == [] and "\n" not in str(info.value) and "(ActorDiedError)" in str(info.value)
