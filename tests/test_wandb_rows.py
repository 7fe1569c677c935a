"""wandb step rows (issue 36): tau in the row of the step it was measured at, the pool per bucket beside it."""
from __future__ import annotations

from app.pool.telemetry import PoolStats, WaitSnapshot
from app.run.outputs.wandb_rows import TauRows, pool_keys


def _row(step: int) -> dict:
    return {"step": step, "loss": 3.0 - 0.1 * step}


def _steps(rows: list[dict]) -> list:
    return [r.get("step", r.get("event")) for r in rows]


def test_tau_lands_in_the_row_of_its_step():
    book, out = TauRows(every=2), []
    for step in (1, 2, 3, 4):
        out += book.add_row(_row(step))
    assert _steps(out) == [1]  # step 2 was offered for evaluation: it and every later row wait
    out += book.add_tau(2, 2.5, 2.5)
    assert _steps(out) == [1, 2, 3]  # step 4 is offered too
    assert out[1]["tau"] == 2.5 and out[1]["tau_best"] == 2.5 and "tau" not in out[2]
    out += book.add_row({"event": "fault"})  # an event keeps its place behind the rows still waiting
    out += book.add_tau(4, 2.0, 2.5)
    assert _steps(out) == [1, 2, 3, 4, "fault"] and (out[3]["tau"], out[3]["tau_best"]) == (2.0, 2.5)


def test_a_tau_that_will_not_come_releases_its_rows():
    book = TauRows(every=2)
    out = [r for s in (1, 2, 3) for r in book.add_row(_row(s))]
    assert _steps(out) == [1]
    out += book.give_up(2)  # timed out, failed or replaced by a newer offer
    assert _steps(out) == [1, 2, 3] and "tau" not in out[1]
    # A later step's tau means the earlier offer was skipped: its rows go out, the later one gets its tau.
    out = [r for s in (4, 5, 6, 7) for r in book.add_row(_row(s))] + book.add_tau(6, 3.0, 3.0)
    assert _steps(out) == [4, 5, 6, 7] and out[2]["tau"] == 3.0 and "tau" not in out[0]


def test_the_hold_is_bounded_and_a_late_tau_is_its_own_row():
    book = TauRows(every=2, max_held=3)
    out = [r for s in range(1, 8) for r in book.add_row(_row(s))]
    # Step 2 is let go when 4 rows wait, step 4 likewise: at most 3 rows wait behind an evaluation.
    assert _steps(out) == [1, 2, 3, 4, 5] and _steps(book.held) == [6, 7]
    late = book.add_tau(2, 1.5, 1.5)  # its row is written: the tau is its own (event) row
    assert late == [{"event": "eval", "eval_step": 2, "tau": 1.5, "tau_best": 1.5}]
    assert _steps(book.flush()) == [6, 7]


def test_without_evaluations_nothing_is_held():
    book = TauRows(every=0)
    assert _steps([r for s in range(1, 5) for r in book.add_row(_row(s))]) == [1, 2, 3, 4]


def test_pool_keys_per_bucket():
    stats = PoolStats(q_hsb=[3, 0, 5], pool_bytes=0, capacity_bytes=0, capacity_items=16, pending=0, in_flight=0,
                      buffered=8, leased=0, acked=0, total_jobs=0, pull_waits=WaitSnapshot(4, 1.0, 0.1, 0.4),
                      served_per_bucket=[10, 2, 7], produced_per_bucket=[13, 2, 12], in_flight_by_target={},
                      oldest_in_flight_age_s={}, done_by_target={}, tokens_by_target={}, forward_s_by_target={},
                      leased_by_drafter={}, acked_twice=0, stale_results=0, stale_acks=0, lost_payloads=0,
                      bytes_overshoot=0, producing_finished=False, done=False)
    keys = pool_keys(stats)
    assert {k: keys[k] for k in ("pool/bucket0/queued", "pool/bucket2/queued", "pool/bucket1/pulls",
                                 "pool/bucket2/produced")} == {"pool/bucket0/queued": 3, "pool/bucket2/queued": 5,
                                                               "pool/bucket1/pulls": 2, "pool/bucket2/produced": 12}
    assert (keys["pool/pull_waits"], keys["pool/pull_wait_p95_s"], keys["pool/buffered"]) == (4, 0.4, 8)
    assert len(keys) == 3 * 3 + 5 and pool_keys(None) == {}


def test_the_runner_names_the_offers_that_will_not_report(tmp_path):
    """Offers replaced in the pool before the runner took them, and the one replaced while waiting here,
    are given up on (their rows go out without tau); the running one is not."""
    from types import SimpleNamespace

    from app.config.load import load_config
    from app.run.evaluate.runner import EvalRunner, offered_every
    from app.run.outputs.monitor import RunMonitor

    cfg = load_config("conf/tiny.yaml", [f"checkpoint.dir={tmp_path}", "eval.every_steps=2"])
    offers = [(2, ["w2"]), (8, ["w8"]), (10, ["w10"])]  # rank 0 offered 4 and 6 too: the pool replaced them
    pool = SimpleNamespace(take_eval=lambda: offers.pop(0) if offers else None, pause_target=lambda t: None)
    plan = SimpleNamespace(cfg=cfg, eval_prompts=[[1, 2]], mask_token_id=3, resume_step=0)
    mon = RunMonitor()
    runner = EvalRunner(plan, None, pool, lambda: {}, mon, None, print)  # no target alive: 2 is taken, never started
    stats = SimpleNamespace(in_flight_by_target={})
    for _ in range(3):
        runner.add_pool(stats)
    # The offered steps the run's monitor is built with (wandb holds their rows): none without held-out prompts.
    assert offered_every(plan) == 2 and offered_every(SimpleNamespace(cfg=cfg, eval_prompts=[])) == 0
    assert mon.tau_given_up == [2, 4, 6, 8]  # 2 and 8 replaced while waiting, 4 and 6 in the pool; 10 waits
