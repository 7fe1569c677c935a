"""The chaos rehearsal numbers its faults out of all of them: the sticky target, fired before the injector
thread starts, counts in both the number and the total. Before: "fault 8/7" at 8 faults."""
from __future__ import annotations

import random

from app.bench.runs import chaos


class LiveDriver:
    def poll(self):
        return None


def test_the_labels_run_to_8_of_8_with_the_sticky_target_fired_first(tmp_path, monkeypatch, capsys) -> None:
    rng = random.Random(0)
    kinds = chaos.plan_faults(8, rng)
    assert len(kinds) == 8 and "sticky" in kinds
    kinds.remove("sticky")
    state = chaos.ChaosState(driver=LiveDriver())
    chaos.sticky_override(rng, 2, state)
    monkeypatch.setattr(chaos, "_wait_training", lambda *a, **k: True)
    monkeypatch.setattr(chaos, "fire", lambda kind, driver, rng: f"killed a {kind}")
    monkeypatch.setattr(chaos, "_group_starts", lambda step_log: 0)
    chaos.inject(state, kinds, rng, tmp_path / "steps.jsonl", total=8)
    labels = [line.split("] ", 1)[1].split(":")[0] for line in capsys.readouterr().out.splitlines() if "] fault " in line]
    assert labels == [f"fault {i}/8" for i in range(2, 9)]


def test_without_a_given_total_the_injector_counts_what_was_fired_before_it(tmp_path, monkeypatch, capsys) -> None:
    state = chaos.ChaosState(driver=LiveDriver(), fired=["sticky target 0"])
    monkeypatch.setattr(chaos, "_wait_training", lambda *a, **k: True)
    monkeypatch.setattr(chaos, "fire", lambda kind, driver, rng: f"killed a {kind}")
    monkeypatch.setattr(chaos, "_group_starts", lambda step_log: 0)
    chaos.inject(state, ["target", "drafter"], random.Random(1), tmp_path / "steps.jsonl")
    assert "fault 3/3: killed a drafter" in capsys.readouterr().out
