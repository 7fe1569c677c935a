"""Evaluation during the run, the policy: one at a time, newest offer wins, least-loaded target, best tau."""
from __future__ import annotations

from app.run.evaluate.schedule import EvalOffer, EvalSchedule, TauBook


def test_one_evaluation_at_a_time_and_the_newest_offer_wins():
    s = EvalSchedule(timeout_s=30.0)
    s.offer(EvalOffer(20, "w20"))
    run = s.start({0: 2, 1: 0, 2: 1}, [0, 1, 2], now=0.0)
    assert (run.offer.step, run.target_id) == (20, 1)  # target 1 holds no training job
    s.offer(EvalOffer(40, "w40"))
    s.offer(EvalOffer(60, "w60"))  # training ran ahead: 40 is never evaluated
    assert s.start({}, [0, 1, 2], now=1.0) is None  # 20 still running
    assert s.finished().offer.step == 20
    assert s.start({0: 0, 1: 0}, [0, 1], now=2.0).offer.step == 60 and s.superseded == 1
    s.finished()
    assert s.start({}, [0], now=3.0) is None  # nothing pending


def test_overdue_and_stale_offers():
    s = EvalSchedule(timeout_s=10.0)
    s.offer(EvalOffer(20, "w"))
    s.start({}, [3], now=0.0)
    assert not s.overdue(5.0) and s.overdue(10.5)
    s.finished()
    s.offer(EvalOffer(20, "again"))  # a rebuilt group passing step 20 again
    assert s.pending is None
    assert s.start({}, [], now=11.0) is None  # no live target: keep waiting


def _res(step, tau):
    return {"step": step, "tau": tau, "per_pos_accept": [round(tau / 10, 3)], "matches_greedy": True, "lossless": True,
            "mismatch_rate": 0.0, "exported_to": "best"}


def test_tau_book_keeps_history_and_the_strict_best():
    book = TauBook()
    assert book.best_tau == float("-inf")
    assert book.record(_res(20, 1.8)) and book.record(_res(40, 2.6))
    assert not book.record(_res(60, 2.6))  # a tie is not better: the earlier drafter stays
    assert not book.record(_res(80, 2.1))
    s = book.summary()
    assert s["tau_history"] == [[20, 1.8], [40, 2.6], [60, 2.6], [80, 2.1]]
    assert s["tau_best"] == {"step": 40, "tau": 2.6, "dir": "best"}
    assert s["tau_last_per_pos_accept"] == [0.21] and s["tau_matches_greedy"] is True


def test_a_resumed_run_keeps_its_earlier_taus_and_best(tmp_path):
    import json
    from types import SimpleNamespace

    from app.config.load import load_config
    from app.model.drafter_tau import META_KEY
    from app.run.evaluate.runner import EvalRunner
    from app.run.outputs.monitor import RunMonitor

    cfg = load_config("conf/tiny.yaml", [f"checkpoint.dir={tmp_path}"])
    (tmp_path / "drafter-best").mkdir()
    (tmp_path / "drafter-best" / "config.json").write_text(json.dumps({META_KEY: {"step": 40, "tau": 3.0}}))
    earlier = [{"k": "eval", "step": s, "tau": t, "per_pos_accept": [0.5], "matches_greedy": True}
               for s, t in ((20, 2.0), (40, 3.0), (60, 2.5))]
    mon = RunMonitor()
    plan = SimpleNamespace(cfg=cfg, eval_prompts=[[1, 2]], mask_token_id=3)
    runner = EvalRunner(plan, None, None, lambda: [], mon, None, print, earlier)
    assert runner.book.best_tau == 3.0 and runner.book.best["exported_to"] == str(tmp_path / "drafter-best")
    assert mon.tau_best == (40, 3.0) and mon.tau_history[-1] == (60, 2.5)
    assert runner.summary()["tau_history"] == [[20, 2.0], [40, 3.0], [60, 2.5]]
