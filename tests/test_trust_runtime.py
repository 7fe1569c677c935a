"""Issue 22, runtime trust: the end-of-run tau never raises and each measurement has its own budget
(item 16), non-finite steps (item 4), the content-keyed data cache (item 9), the regenerate output
(item 8), the throwaway cluster's auth (item 12) and the remaining bad inputs (item 18)."""
from __future__ import annotations

import time

import pytest

from app.model.drafter_tau import EvalSpec
from app.run.evaluate.final_tau import FinalTau

from app.config.run_sections import EvalConfig  # noqa: E402

SPEC = EvalSpec(prompts=[[1, 2, 3]], drafter=None, eval=EvalConfig(race_prompts=0), mask_token_id=0, seed=0,
                eos_token_id=None)


# ---- item 16: the end-of-run tau -----------------------------------------------------------------


class _Clock:
    """A virtual clock: the fake waits below advance it by what each evaluation takes."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Target:
    """A target handle whose evaluations take `seconds` each, run one at a time as an actor runs them."""

    def __init__(self, clock: _Clock, seconds: float, tau: float) -> None:
        self.clock, self.seconds, self.tau, self.busy_until = clock, seconds, tau, 0.0
        self.evaluate_weights = self

    def remote(self, step, weights, spec, best_dir, beat_tau):
        start = max(self.clock.now, self.busy_until)
        self.busy_until = start + self.seconds
        return (self, self.busy_until, {"tau": self.tau + step})


def _fake_get(clock: _Clock):
    from ray.exceptions import GetTimeoutError

    def get(ref, timeout):
        _, done_at, value = ref
        if done_at > clock.now + timeout:
            clock.now += timeout
            raise GetTimeoutError("timed out")
        clock.now = max(clock.now, done_at)
        return value

    return get


def test_final_tau_one_target_gives_each_measurement_its_own_budget() -> None:
    """Item 16: on one target the trained evaluation waits behind the untrained one; each takes 0.8 of
    eval.timeout_s, so a shared budget timed the trained one out."""
    clock = _Clock()
    target = _Target(clock, seconds=8.0, tau=1.0)
    final = FinalTau(SPEC, 10.0, clock, log=lambda _m: None, get=_fake_get(clock))
    result = final.measure([(0, target)], "/export", step=5)
    assert (result.untrained, result.trained, result.reason) == (1.0, 6.0, None)
    assert clock.now == 16.0


def test_final_tau_skips_a_hung_target_in_both_measurements() -> None:
    """Item 16: a target that hangs past eval.timeout_s is skipped, by the other measurement too."""
    clock = _Clock()
    hung, healthy = _Target(clock, seconds=1e9, tau=0.0), _Target(clock, seconds=1.0, tau=2.0)
    logs: list[str] = []
    final = FinalTau(SPEC, 10.0, clock, log=logs.append, get=_fake_get(clock))
    result = final.measure([(0, hung), (1, healthy)], "/export", step=3)
    assert (result.untrained, result.trained, result.reason) == (2.0, 5.0, None)
    assert logs == ["WARNING: tau evaluation on target 0 failed (target 0 gave no answer within "
                    "eval.timeout_s=10 s); trying the next target"]


def test_final_tau_never_raises() -> None:
    """Item 16: whatever a target call raises, measure reports it and returns."""

    class Broken:
        class evaluate_weights:  # noqa: N801 - stands for an actor method
            @staticmethod
            def remote(*_a):
                raise ValueError("boom")

    logs: list[str] = []
    result = FinalTau(SPEC, 1.0, _Clock(), logs.append, get=_fake_get(_Clock())).measure([(0, Broken())], "/e", 1)
    assert (result.untrained, result.trained, result.reason) == (None, None, "ValueError: boom")
    assert logs == ["WARNING: end-of-run tau not measured (ValueError: boom)"]


@pytest.mark.ray
def test_final_tau_on_a_real_hanging_target_returns(ray_cluster) -> None:
    """Item 16 with Ray: an actor that never answers in time. ray.cancel(force=True) on its task raised
    ValueError (a traceback, exit 1, no summary.json); now both measurements come back None with why."""
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Hanging:
        def evaluate_weights(self, step, weights, spec, best_dir, beat_tau):
            time.sleep(30)
            return {"tau": 1.0}

    actor = Hanging.remote()
    try:
        result = FinalTau(SPEC, 0.5, time.monotonic, log=lambda _m: None).measure([(7, actor)], "/export", 2)
    finally:
        ray.kill(actor)
    assert (result.untrained, result.trained) == (None, None)
    assert result.reason == ("untrained: target 7 gave no answer within eval.timeout_s=0.5 s; "
                             "trained: every live target hung in the other measurement")


# ---- item 9: the data cache is keyed by content -----------------------------------------------------


def test_a_same_size_rewrite_with_its_old_mtime_misses_the_cache(tmp_path) -> None:
    """Item 9: the key was (path, size, mtime): rewriting a file with other bytes of the same length and
    putting its mtime back reused the stale tokens (and the resume fingerprint, made of them, matched)."""
    import json
    import os

    from app.config.run_sections import CheckpointConfig
    from app.config.schema import Config, DataConfig, ModelConfig
    from app.data import pipeline
    from tests.chat_toys import QWEN_TEMPLATE, bpe_tokenizer

    model_dir = tmp_path / "tok"
    tokenizer = bpe_tokenizer(QWEN_TEMPLATE)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "a.jsonl"
    ids = list(range(5, 45))
    data.write_text(json.dumps({"input_ids": ids, "loss_mask": [0] * 8 + [1] * 32}) + "\n")
    stat = data.stat()
    cfg = Config(model=ModelConfig(target="tiny"), data=DataConfig(train_files=[str(data)], num_workers=1),
                 checkpoint=CheckpointConfig(dir=str(tmp_path / "run")))
    logs: list[str] = []

    def load():
        logs.clear()
        return pipeline.load_or_tokenize(cfg, str(model_dir), tokenizer, [str(data)], progress=False, log=logs.append)

    first = load()
    assert logs[0].startswith("data: tokenized") and list(first.tokens[:3]) == [5, 6, 7]
    swapped = [6, 5] + ids[2:]  # the same length in bytes: same size
    data.write_text(json.dumps({"input_ids": swapped, "loss_mask": [0] * 8 + [1] * 32}) + "\n")
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (data.stat().st_size, data.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    second = load()
    assert logs[0].startswith("data: tokenized") and list(second.tokens[:3]) == [6, 5, 7]
    assert load() is not None and logs[0].startswith("data: loaded")  # unchanged bytes: a hit


# ---- item 12: the throwaway cluster keeps Ray's token auth -------------------------------------------

_DRIVER = """
import json, os, subprocess, sys
import ray
from app.ray_cluster import init_ray
init_ray()
gcs = ray.get_runtime_context().gcs_address
answer = ray.get(ray.remote(lambda: 41 + 1).remote())  # the cluster's own workers authenticate
env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
probe = "import ray, sys; ray.init(address=sys.argv[1], configure_logging=False, log_to_driver=False); print(len(ray.nodes()))"
stranger = subprocess.run([sys.executable, "-c", probe, gcs], env=env | {"RAY_AUTH_MODE": "disabled"},
                          capture_output=True, text=True)
print(json.dumps({"mode": os.environ.get("RAY_AUTH_MODE"), "answer": answer, "stranger_rc": stranger.returncode,
                  "stranger_out": stranger.stdout, "stranger_err": stranger.stderr[-400:],
                  "token_file": os.path.exists(os.path.expanduser("~/.ray/auth_token"))}))
ray.shutdown()
"""


@pytest.mark.ray
@pytest.mark.slow
def test_the_throwaway_cluster_refuses_a_process_without_its_token(tmp_path) -> None:
    """Item 12 with a real ray.init: the driver's own local cluster set RAY_AUTH_MODE=disabled, so a second
    process without any token listed the nodes (and could call the pool). Now it keeps Ray's token auth
    with a per-run secret: the cluster's workers run tasks, a stranger's ray.init is refused, and no
    token file (which Ray writes readable by all) appears in HOME."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    env["HOME"] = str(tmp_path)
    run = subprocess.run([sys.executable, "-c", _DRIVER], env=env, capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert (got["mode"], got["answer"], got["token_file"]) == ("token", 42, False)
    assert got["stranger_rc"] != 0 and got["stranger_out"] == "", got
    assert "ConnectionError" in got["stranger_err"] or "uthentication" in got["stranger_err"], got


# ---- item 18: a corrupt Parquet file -----------------------------------------------------------------


def _parquet(path, rows: int = 3) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    msgs = [{"role": "user", "content": "ba be"}, {"role": "assistant", "content": "bi bo " * 20}]
    pq.write_table(pa.table({"messages": [msgs] * rows}), path)
    return path.read_bytes()


def test_a_corrupt_parquet_row_group_is_malformed_records_and_a_truncated_file_a_data_error(tmp_path) -> None:
    """Item 18: pyarrow's ArrowInvalid/OSError reached the user as a traceback, exit 1. A file that cannot
    be opened is one data error line; a row group that cannot be read is one malformed record per row,
    so data.on_error=skip drops and counts them and raise names the file and row."""
    from app.data.formats import iter_records
    from app.data.records import DataError, MalformedRecord

    good = _parquet(tmp_path / "good.parquet")
    (tmp_path / "cut.parquet").write_bytes(good[: len(good) // 2])
    with pytest.raises(DataError, match=r"cut\.parquet' is not a readable Parquet file \(Parquet magic bytes"):
        list(iter_records(str(tmp_path / "cut.parquet")))
    bad = bytearray(good)
    bad[10:60] = b"\xff" * 50  # inside the first data page's header
    (tmp_path / "page.parquet").write_bytes(bytes(bad))
    got = list(iter_records(str(tmp_path / "page.parquet")))
    assert [row for row, _ in got] == [1, 2, 3] and all(isinstance(r, MalformedRecord) for _, r in got)
    assert str(got[0][1]).startswith("unreadable Parquet row group 0: ")


@pytest.mark.slow  # reuses (or builds) the tiny target
def test_a_truncated_parquet_file_exits_2_with_one_line(tmp_path) -> None:
    """Item 18 through `python -m app.train`: one line, exit 2, no traceback."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    good = _parquet(tmp_path / "good.parquet")
    data = tmp_path / "train.parquet"
    data.write_bytes(good[: len(good) // 2])
    proc = subprocess.run([sys.executable, "-m", "app.train", "--config", str(root / "conf/tiny.yaml"),
                           f"data.train_files=[{data}]", f"tiny.cache_dir={root / '.cache/tiny'}",
                           f"checkpoint.dir={tmp_path / 'run'}"], cwd=root, capture_output=True, text=True, timeout=300)
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert (proc.returncode, len(err)) == (2, 1), proc.stderr[-2000:]
    assert err[0].startswith(f"data error: data file '{data}' is not a readable Parquet file (Parquet magic bytes")


# ---- item 18: the placement group's timeout -----------------------------------------------------------


@pytest.mark.ray
def test_a_placement_group_that_never_fits_is_one_config_error_line(ray_cluster) -> None:
    """Item 18: past the timeout Topology raised RuntimeError (a traceback, exit 1); now a ConfigError (the
    driver prints its one line and exits 2 for errors raised while supervising too) saying what is free."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from app.config.errors import ConfigError
    from app.run.placement import wait_placement

    bundles = [{"CPU": 1.0}, {"CPU": 1000.0}]  # more than the cluster has: never ready
    pg = placement_group(bundles, strategy="PACK")
    try:
        with pytest.raises(ConfigError) as err:
            wait_placement(pg, bundles, timeout_s=0.5)
    finally:
        remove_placement_group(pg)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("the placement group of 2 bundles (1001 CPU) was not ready after 0.5 s: the cluster has ")
    assert " of 16 CPU free; " in line and line.endswith("lower topology.num_targets / num_drafters")


def test_a_user_error_while_supervising_exits_2_with_one_line(monkeypatch, capsys) -> None:
    """Item 18: errors found once the run started (the placement group's timeout, a failed wandb.init)
    were outside the driver's UserError handling: a traceback, exit 1."""
    from types import SimpleNamespace

    from app.config.errors import ConfigError
    from app.run import driver

    class Lease:
        def release(self) -> None:
            pass

    def supervise(*_a):
        raise ConfigError("the placement group of 2 bundles (9 CPU) was not ready after 120 s: ...")

    plan = SimpleNamespace()
    for name, fake in {"check_dir_shared": lambda _c: None, "take_lease": lambda _c: Lease(),
                       "make_plan": lambda _c: plan, "connect": lambda _c: SimpleNamespace(use_gpu=False),
                       "preflight": lambda p, _cluster: {"": p}, "supervise": supervise}.items():
        monkeypatch.setattr(driver, name, fake)
    assert driver.run(SimpleNamespace(runs=[])) == 2  # one run, no sweep
    assert capsys.readouterr().err == ("config error: the placement group of 2 bundles (9 CPU) was not ready "
                                       "after 120 s: ...\n")


# ---- item 18: a bench starts its own cluster ------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.slow
def test_bench_pool_starts_its_own_cluster_beside_another(ray_cluster) -> None:
    """Item 18: with another cluster reachable (RAY_ADDRESS, as `ray start` leaves for the machine), the
    bench joined it and died: "When connecting to an existing cluster, num_cpus and num_gpus must not be
    provided". It now starts its own (app.ray_cluster.start_own_cluster, which bench sched calls too)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    gcs = ray_cluster.get_runtime_context().gcs_address
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {"RAY_ADDRESS": gcs}
    proc = subprocess.run([sys.executable, "-m", "app.bench", "pool", "--items", "20", "--producers", "1",
                           "--consumers", "1", "--kib", "1", "--repeats", "1", "--batches", "1"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1].startswith("RESULT pool_pairs_per_s=")
