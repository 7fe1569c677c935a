"""The measured speedup at the end of a run (eval.race_prompts): the exported drafter against the target alone,
batch 1, outputs compared token for token; into summary.json's `speed_race` and report.html's serving table."""
from __future__ import annotations

import re

import pytest
import torch

from app.config.drafter_sections import DrafterConfig
from app.config.run_sections import EvalConfig
from app.model.build import build_or_load_drafter
from app.model.export import export_drafter
from app.model.drafter_tau import EvalSpec, race_exported
from app.run.evaluate.final_tau import FinalTau
from app.run.outputs.report_page import render
from tests.test_trust_runtime import _Clock, _fake_get, _Target
from tests.toy import LAYERS, PROMPTS

DCFG = DrafterConfig(num_layers=1, block_size=4)


class _RacingTarget(_Target):
    """A fake target whose speed race takes `race_s` seconds of the virtual clock."""

    def __init__(self, clock, seconds, tau, race_s: float) -> None:
        super().__init__(clock, seconds, tau)
        self.race_s, self.raced = race_s, []
        outer = self

        class _Race:
            @staticmethod
            def remote(folder, spec):
                outer.raced.append((folder, spec.eval.race_prompts))
                start = max(clock.now, outer.busy_until)
                outer.busy_until = start + race_s
                return (outer, outer.busy_until, {"speedup": 1.5, "identical": True})

        self.race_weights = _Race


def _spec(race_prompts: int) -> EvalSpec:
    return EvalSpec([[1, 2, 3]], DCFG, EvalConfig(race_prompts=race_prompts), 0, 0, None)


def test_the_race_follows_the_trained_tau_on_a_live_target_with_its_own_budget() -> None:
    clock = _Clock()
    target = _RacingTarget(clock, seconds=8.0, tau=1.0, race_s=9.0)
    result = FinalTau(_spec(2), 10.0, clock, log=lambda _m: None, get=_fake_get(clock)).measure([(0, target)], "/x", 5)
    assert (result.untrained, result.trained, result.reason) == (1.0, 6.0, None)
    assert result.race == {"speedup": 1.5, "identical": True} and target.raced == [("/x", 2)]
    assert clock.now == 25.0  # 8 + 8 + 9: three calls one after another, each within its own 10 s


def test_a_hung_race_is_reported_and_keeps_the_taus() -> None:
    clock = _Clock()
    target = _RacingTarget(clock, seconds=1.0, tau=2.0, race_s=1e9)
    result = FinalTau(_spec(2), 10.0, clock, log=lambda _m: None, get=_fake_get(clock)).measure([(3, target)], "/x", 1)
    assert (result.untrained, result.trained, result.race) == (2.0, 3.0, None)
    assert result.reason == "race: target 3 gave no answer within eval.timeout_s=10 s"


def test_no_race_when_off_or_nothing_was_exported() -> None:
    for spec, export in ((_spec(0), "/x"), (_spec(2), None)):
        clock = _Clock()
        target = _RacingTarget(clock, seconds=1.0, tau=2.0, race_s=1.0)
        result = FinalTau(spec, 10.0, clock, log=lambda _m: None, get=_fake_get(clock)).measure([(0, target)], export, 1)
        assert result.race is None and target.raced == []


def test_report_prints_the_measured_speedup_beside_the_estimate() -> None:
    race = {"prompts": 4, "greedy_tok_s": 20.0, "spec_tok_s": 31.0, "speedup": 1.55, "identical": True, "tau": 2.4,
            "seconds": 12.0}
    section = re.search(r'<section id="serving">.*?</section>', render([], {"speed_race": race}), re.S).group(0)
    assert "1.55x: speculative 31.0 tok/s against the target alone 20.0 tok/s" in section
    assert "4 held-out prompts, tau 2.4" in section and "identical to plain greedy" in section
    broken = render([], {"speed_race": {**race, "identical": False}})
    assert "DIFFERENT from plain greedy" in broken


@pytest.mark.slow
def test_race_exported_times_both_decoders_on_the_same_prompts_with_identical_output(tiny_target, tmp_path) -> None:
    model, path = tiny_target
    drafter, head, arch = build_or_load_drafter(str(path), None, DCFG, LAYERS, 3, torch.device("cpu"), torch.float32, 7)
    folder = export_drafter(drafter, arch, tmp_path / "drafter")
    spec = EvalSpec(PROMPTS, DCFG, EvalConfig(max_new_tokens=12, race_prompts=2), 3, 0, None)
    line = race_exported(model, str(path), LAYERS, str(folder), spec, torch.device("cpu"), torch.float32)
    assert line.prompts == 2 and line.identical
    assert line.speedup == pytest.approx(line.spec_tok_s / line.greedy_tok_s)
    assert line.greedy_tok_s > 0 and line.spec_tok_s > 0 and line.tau >= 1.0


def test_the_end_of_run_measures_at_normal_priority_the_run_in_the_idle_class() -> None:
    """The end of the run has the cores: its evaluations must not run in the idle class, which gets no CPU while
    anything else runs on the machine (the smol run's final tau timed out that way beside another process)."""
    clock, seen = _Clock(), []
    target = _RacingTarget(clock, seconds=1.0, tau=2.0, race_s=1.0)
    plain = target.remote
    target.evaluate_weights = type("E", (), {"remote": staticmethod(lambda *a: seen.append(a[2].background) or plain(*a))})
    spec = _spec(0)
    assert spec.background  # what the runner's evaluations during the run get
    FinalTau(spec, 10.0, clock, log=lambda _m: None, get=_fake_get(clock)).measure([(0, target)], "/x", 1)
    assert seen == [False, False]


def test_a_dead_target_is_passed_over_for_the_race() -> None:
    """The target picked first died after training (its call raises): the race runs on the next live one."""
    from ray.exceptions import RayActorError

    clock = _Clock()
    dead = _RacingTarget(clock, seconds=1.0, tau=2.0, race_s=1.0)

    class _Dead:
        @staticmethod
        def remote(*_a):
            raise RayActorError()

    dead.race_weights = _Dead
    alive = _RacingTarget(clock, seconds=1.0, tau=2.0, race_s=1.0)
    result = FinalTau(_spec(2), 10.0, clock, log=lambda _m: None, get=_fake_get(clock)).measure(
        [(0, dead), (1, alive)], "/x", 1)
    assert result.race == {"speedup": 1.5, "identical": True} and alive.raced == [("/x", 2)]
    assert result.reason is None
