"""The benches' shared plumbing (app/bench/common.py): the RESULT line as the README quotes it, configs with
overrides, and the worker pool giving the figures a loop here gives."""
from __future__ import annotations

import pytest

from app.bench.common import ROOT, bench_config, map_in_processes, parse_result, result_line


def test_result_line_keeps_the_order_and_the_benches_format() -> None:
    line = result_line({"side": "drafters", "repeats": 1, "ratio": 4 / 3, "off_tok_s": f"{1700.04:.1f}",
                        "beats_ngram": True, "split": "4/4"})
    assert line == "RESULT side=drafters repeats=1 ratio=1.333 off_tok_s=1700.0 beats_ngram=True split=4/4"
    assert result_line([("a", 0.5)], digits=1) == "RESULT a=0.5"
    assert parse_result(f"some output\nRESULT x=1\nmore\n{line}\n") == {
        "side": "drafters", "repeats": "1", "ratio": "1.333", "off_tok_s": "1700.0", "beats_ngram": "True",
        "split": "4/4"}


@pytest.mark.parametrize("fields", [{"two words": 1}, {"k": "two words"}, {"k=v": 1}, {"k": ""}])
def test_a_field_that_would_not_parse_back_is_refused(fields) -> None:
    with pytest.raises(ValueError, match="RESULT field"):
        result_line(fields)


def test_no_result_line_is_an_error_not_an_empty_answer() -> None:
    with pytest.raises(ValueError, match="no RESULT line"):
        parse_result("RESULTS are in\n")


def test_bench_config_reads_the_repository_conf_and_later_overrides_win() -> None:
    assert (ROOT / "conf" / "tiny.yaml").is_file()
    cfg = bench_config("tiny", ["train.epochs=2", "topology.num_targets=3", "train.epochs=3"])
    assert (cfg.train.epochs, cfg.topology.num_targets, cfg.topology.num_drafters) == (3, 3, 3)


def _square_plus(x: int, y: int) -> int:
    return x * x + y


def test_map_in_processes_gives_the_in_process_answers_in_order() -> None:
    args = [(3, 1), (1, 0), (2, 5)]
    assert map_in_processes(_square_plus, args, workers=1) == [10, 1, 9]
    assert map_in_processes(_square_plus, args, workers=2) == [10, 1, 9]


def test_a_start_that_misses_rays_registration_is_cleaned_up_and_tried_again(monkeypatch) -> None:
    """own_cluster: the processes a timed-out start left behind are ended (by id), the next start is made;
    another error is raised at once."""
    import subprocess
    import sys

    import psutil

    from app import ray_cluster
    from app.bench.common import own_cluster

    left: list[subprocess.Popen] = []
    calls: list[dict] = []

    def start(**resources) -> None:
        calls.append(resources)
        if len(calls) == 1:  # a GCS-like child that outlives the failed start
            left.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
            raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(ray_cluster, "start_own_cluster", start)
    assert own_cluster(3, object_store_memory=10).__name__ == "ray"
    assert calls == [{"num_cpus": 3, "object_store_memory": 10}] * 2
    assert not psutil.pid_exists(left[0].pid)  # ended (and reaped) before the second start, not left running
    calls.clear()

    def broken(**resources) -> None:
        calls.append(resources)
        raise Exception("something else")

    monkeypatch.setattr(ray_cluster, "start_own_cluster", broken)
    with pytest.raises(Exception, match="something else"):
        own_cluster(3)
    assert len(calls) == 1
