"""How every run ends (app/run/finish.py), one run or a sweep's: the non-finite stop names the run, a stop
(SIGTERM) ends every run's wandb run at its own step, and the RESULT line leaves lists and dicts to summary.json.
No Ray: each run's supervisor is a stand-in with the outcome a real one returns."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.run.finish import RunEnd, check_finite, result_line, stop_runs
from app.run.supervise.events import RunFailed


class _Wandb:
    def __init__(self) -> None:
        self.finished: list[dict] = []

    def finish(self, summary: dict, exit_code: int = 0) -> None:
        self.finished.append(summary)


def _end(name: str, steps: int, stopped: bool = False, nonfinite: str = "") -> RunEnd:
    said: list[str] = []
    result = SimpleNamespace(nonfinite=nonfinite, export_dir=None)
    sup = SimpleNamespace(outcome=SimpleNamespace(steps=steps, stopped=stopped, drafter_results=[result]),
                          log=said.append, said=said)
    return RunEnd(name, sup, outputs=None, wandb=_Wandb())


def test_a_non_finite_step_fails_the_run_and_names_it_in_a_sweep():
    with pytest.raises(RunFailed, match=r"^step 7 is non-finite \(loss nan\); stopped before checkpointing"):
        check_finite({"": _end("", 7, nonfinite="loss nan")})
    ends = {"a": _end("a", 5), "b": _end("b", 9, nonfinite="grad_norm inf")}
    with pytest.raises(RunFailed, match=r"^run b: step 9 is non-finite \(grad_norm inf\).*train.on_nonfinite=skip$"):
        check_finite(ends)
    check_finite({"a": _end("a", 5), "b": _end("b", 9)})  # all finite: nothing raised


def test_a_stop_ends_every_run_at_its_own_step():
    ends = {"a": _end("a", 4, stopped=True), "b": _end("b", 6, stopped=True)}
    assert stop_runs(ends) is True
    for end, steps in ((ends["a"], 4), (ends["b"], 6)):
        assert end.wandb.finished == [{"stopped_at_step": steps}]
        assert end.sup.said == [f"stopped cleanly at step {steps}; resubmit the same command to resume"]
    done = {"": _end("", 12)}
    assert stop_runs(done) is False and done[""].wandb.finished == [] and done[""].sup.said == []


def test_the_result_line_keeps_scalars_formats_floats_and_redacts():
    line = result_line({"steps": 68, "tau_trained": 5.150684931, "fault_log": ["x"], "data": {"kept": 1},
                        "verifier": "s3://key:secret@bucket/model"})
    assert line == "RESULT steps=68 tau_trained=5.151 verifier=s3://***@bucket/model"
