"""Issue 35, H6: `python -m app.regenerate` waited for a generator's result with no deadline, so one
wedged actor hung the run forever. The dispatcher (app/data/regen_dispatch.py) gives each chunk a
deadline, re-queues a late chunk on another actor and has the wedged one restarted. Pure: a fake
clock, and a hang injected by never reporting a chunk done."""
from __future__ import annotations

from app.data.regen_dispatch import Assign, ChunkDispatcher, Restart


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_wedged_actor_s_chunks_move_to_another_actor_and_it_is_restarted() -> None:
    clock = Clock()
    d = ChunkDispatcher(4, 2, timeout_s=10, clock=clock)
    assert d.assignments() == [Assign(0, 0), Assign(0, 1), Assign(1, 2), Assign(1, 3)]
    clock.t = 5
    d.done(1, 2)
    clock.t = 8
    d.done(1, 3)  # slot 1 idle; slot 0 hangs from t=0 on
    assert d.overdue() == [] and d.wait_s() == 2.0
    clock.t = 10.5
    assert d.overdue() == [Restart(0, (0, 1), (), "no chunk finished for 10 s (the deadline is 10 s)")]
    assert d.assignments() == [Assign(1, 0), Assign(1, 1)]  # on the other actor, not the wedged one
    clock.t = 12
    d.done(1, 0)
    d.done(1, 1)
    assert d.finished and d.given_up == [] and d.restarts == 1


def test_the_deadline_runs_from_the_previous_chunk_s_finish_not_the_submission() -> None:
    """Two queued chunks of 8 s each under a 10 s deadline: neither is late."""
    clock = Clock()
    d = ChunkDispatcher(2, 1, timeout_s=10, clock=clock)
    d.assignments()
    clock.t = 8
    d.done(0, 0)
    clock.t = 16
    assert d.overdue() == []
    d.done(0, 1)
    assert d.finished and d.restarts == 0


def test_a_chunk_that_wedges_every_actor_is_given_up_after_max_attempts() -> None:
    """One actor, a chunk that never finishes: tried three times (the actor restarted each time), then
    given up so the run ends; its records stay out of OUT for the next run to try again."""
    clock = Clock()
    d = ChunkDispatcher(2, 1, timeout_s=10, max_attempts=3, clock=clock, per_slot=1)
    restarts = []
    for _ in range(10):
        for a in d.assignments():
            if a.chunk == 1:
                clock.t += 1
                d.done(a.slot, a.chunk)
        if d.finished:
            break
        clock.t += 11
        restarts += d.overdue()
    assert d.finished and d.given_up == [0] and d.attempts == [3, 1]
    assert [r.chunks for r in restarts] == [(0,), (0,), (0,)] and restarts[-1].given_up == (0,)


def test_a_dead_actor_s_chunks_are_queued_again_first() -> None:
    clock = Clock()
    d = ChunkDispatcher(5, 2, timeout_s=10, clock=clock, per_slot=1)
    assert d.assignments() == [Assign(0, 0), Assign(1, 1)]
    assert d.failed(1) == Restart(1, (1,), (), "its actor died")
    assert list(d.queue) == [1, 2, 3, 4]
    d.done(0, 0)
    assert d.assignments() == [Assign(0, 1), Assign(1, 2)]  # the fresh actor 1 takes the next chunk


def test_a_timeout_that_is_not_positive_is_refused_in_one_line(tmp_path) -> None:
    import pytest

    from app.config.errors import ConfigError
    from app.regenerate import main

    assert main(["--config", "conf/tiny.yaml", "--in", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "o.jsonl"),
                 "--chunk-timeout-s", "0"]) == 2
    with pytest.raises(ConfigError, match="--chunk-timeout-s=-1 must be positive"):
        from app.config.load import load_config
        from app.regenerate import run_regenerate

        run_regenerate(load_config("conf/tiny.yaml", []), "x", str(tmp_path / "o.jsonl"), max_new_tokens=1,
                       chunk_timeout_s=-1)
