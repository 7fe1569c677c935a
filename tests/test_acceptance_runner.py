"""`bench gpu --acceptance` in two parts, each check's time printed and written as it ends (issue 37)."""
from __future__ import annotations

import json

import pytest

from app.bench.compute import acceptance_runner as ar
from app.bench.compute import gpu
from app.bench.compute.gpu_acceptance import CHECKS


class Clock:
    """Each check advances it by its own seconds: times without wall-clock dependence."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _check(clock: Clock, name: str, part: int, seconds: float, status: str = "pass", raises=None, cuda=False):
    def fn(ctx):
        clock.t += seconds
        ctx.setdefault("ran", []).append(name)
        if raises is not None:
            raise raises
        return status, {"value": name.upper()}

    return ar.Check(name, fn, part, cuda, budget_s=seconds)


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_check_is_printed_and_written_with_its_time_as_it_ends(tmp_path, capsys) -> None:
    clock = Clock()
    checks = [_check(clock, "a", 1, 2.0), _check(clock, "b", 1, 3.0, raises=RuntimeError("boom")),
              _check(clock, "c", 1, 0.0, cuda=True), _check(clock, "d", 2, 7.5)]
    ctx: dict = {}
    out = ar.run_checks(checks, ctx, (1, 2), cuda=False, results=tmp_path / "r.jsonl", clock=clock)
    assert [(o.name, o.status, o.seconds) for o in out] == [("a", "pass", 2.0), ("b", "fail", 3.0),
                                                           ("c", "skipped", 0.0), ("d", "pass", 7.5)]
    assert ctx["ran"] == ["a", "b", "d"]  # a failure does not stop the next check
    text = capsys.readouterr().out
    assert "RESULT check=a status=pass part=1 seconds=2.0 value=A" in text
    assert "RESULT check=b status=fail part=1 seconds=3.0 error=RuntimeError message=boom" in text
    assert "  d: pass in 7.5 s (budget 8 s; 12.5 s since the start)" in text
    assert "part 1: 3 checks in 5.0 s" in text and "part 2: 1 checks in 7.5 s" in text
    rows = [r for r in _rows(tmp_path / "r.jsonl") if "check" in r]
    assert [(r["check"], r["part"], r["status"], r["seconds"]) for r in rows] == [
        ("a", 1, "pass", 2.0), ("b", 1, "fail", 3.0), ("c", 1, "skipped", 0.0), ("d", 2, "pass", 7.5)]
    assert ar.summary(out, 12.5) == ("acceptance: 3/4 checks not failed in 12 s; failed: b", 1)


def test_a_run_cut_off_mid_check_keeps_what_finished_on_disk(tmp_path) -> None:
    """The window ends during part 1's third check (the process is interrupted): the file already holds the
    first two results and names the check it was in."""
    clock = Clock()
    checks = [_check(clock, "a", 1, 1.0), _check(clock, "b", 1, 1.0),
              _check(clock, "compile", 1, 300.0, raises=KeyboardInterrupt()), _check(clock, "z", 2, 1.0)]
    with pytest.raises(KeyboardInterrupt):
        ar.run_checks(checks, {}, (1, 2), results=tmp_path / "r.jsonl", clock=clock)
    rows = _rows(tmp_path / "r.jsonl")
    assert [r.get("check") for r in rows if "check" in r] == ["a", "b"]
    assert rows[-1] == {"started": "compile", "part": 1}


def test_part_1_over_its_budget_says_so_and_one_part_runs_alone(tmp_path, capsys) -> None:
    clock = Clock()
    checks = [_check(clock, "slow", 1, ar.PART1_BUDGET_S + 1), _check(clock, "m", 2, 1.0)]
    ar.run_checks(checks, {}, (1,), clock=clock)
    assert f"over its {ar.PART1_BUDGET_S:.0f} s budget" in capsys.readouterr().out
    ctx: dict = {}
    assert [o.name for o in ar.run_checks(checks, ctx, (2,), clock=clock)] == ["m"] and ctx["ran"] == ["m"]


def test_the_dry_run_walks_both_parts_on_cpu_and_part_1_fits_four_minutes(tmp_path, capsys) -> None:
    path = tmp_path / "acc.jsonl"
    assert gpu.main(["--acceptance", "--dry-run", "--results", str(path)]) == 0
    text = capsys.readouterr().out
    printed = [ln.split()[1].split("=")[1] for ln in text.splitlines() if ln.startswith("RESULT check=")]
    assert printed == [c.name for c in CHECKS]
    assert [c.name for c in CHECKS if c.part == 1] == ["environment", "collective", "resume", "cuda_tests", "real_step"]
    assert sum(c.budget_s for c in CHECKS if c.part == 1) <= ar.PART1_BUDGET_S
    assert all(f"  {c.name}: dry_run in " in text for c in CHECKS)
    rows = [r for r in _rows(path) if "check" in r]
    assert [(r["check"], r["part"], r["status"]) for r in rows] == [(c.name, c.part, "dry_run") for c in CHECKS]
    assert gpu.main(["--acceptance", "--dry-run", "--part", "2", "--results", ""]) == 0
    assert "part 1" not in capsys.readouterr().out
