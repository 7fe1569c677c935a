"""Every mistake a user can make before actors start exits 2 with one line, and Ray never starts.

Config mistakes (including `tiny.*` values) are caught by the loader; malformed data under
`data.on_error=raise` by the plan, which the driver makes before `ray.init`.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

TINY_CACHE = f"tiny.cache_dir={ROOT / '.cache/tiny'}"  # shared with the other tests that build the tiny target


def _malformed_data(tmp_path: Path) -> Path:
    good = {"messages": [{"role": "user", "content": "ba be"}, {"role": "assistant", "content": "bi bo " * 20}]}
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(good) + "\n" + "{not json\n")
    return path


def _train_cli(*overrides: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.train", "--config", str(ROOT / "conf/tiny.yaml"), *overrides],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def _train_main(capsys, *overrides: str) -> str:
    """`app.train.main` in this process (what `python -m app.train` runs, less the interpreter start): it
    returns 2 and wrote exactly one line to stderr and nothing to stdout; that line. The exit-code
    contract of the real command line is checked by the subprocess tests here (`_train_cli`)."""
    from app.train import main

    capsys.readouterr()
    code = main(["--config", str(ROOT / "conf/tiny.yaml"), *overrides])
    captured = capsys.readouterr()
    assert code == 2, captured.out[-2000:] + captured.err[-2000:]
    assert not captured.out.strip(), captured.out[-2000:]
    err = [line for line in captured.err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


def _one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


@pytest.fixture
def no_ray(monkeypatch):
    """ray.init fails the test: the error must come before the cluster is touched."""
    import ray

    def refuse(*_a, **_k):
        raise AssertionError("ray.init was called before the user error was reported")

    monkeypatch.setattr(ray, "init", refuse)
    return ray


def test_bad_tiny_value_exits_2_with_one_line_before_ray(capsys, no_ray) -> None:
    from app.train import main

    assert main(["--config", str(ROOT / "conf/tiny.yaml"), "tiny.chain_top_prob=0.4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["config error: tiny.chain_top_prob=0.4 must be in (0.5, 1] so greedy follows the chain"]


def test_bad_tiny_value_cli_one_line() -> None:
    line = _one_line(_train_cli("tiny.hidden_size=66"))
    assert line == "config error: tiny.hidden_size=66 must be a multiple of tiny.num_heads=4"


def _build_tiny_target() -> None:
    """Build (or reuse) the tiny target in the shared cache, as the run under test would first."""
    from app.config.load import load_config
    from app.tiny.build import resolve_target

    resolve_target(load_config(ROOT / "conf/tiny.yaml", [TINY_CACHE, "data.train_files=[]"]))


@pytest.mark.slow  # builds (or reuses) the tiny target
def test_malformed_data_line_exits_2_with_one_line_before_ray(tmp_path, capsys, no_ray) -> None:
    from app.train import main

    data = _malformed_data(tmp_path)
    _build_tiny_target()
    capsys.readouterr()  # a first build's progress bars are not the error line under test
    was_up = no_ray.is_initialized()  # another test of the session may have started Ray in this process
    code = main(["--config", str(ROOT / "conf/tiny.yaml"), f"data.train_files=[{data}]", TINY_CACHE,
                 f"checkpoint.dir={tmp_path / 'run'}"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"data error: {data}:2: malformed record: invalid JSON"), err
    assert err[0].endswith("Fix the record or set data.on_error=skip")
    assert no_ray.is_initialized() == was_up  # and ray.init (which raises here) was never reached


@pytest.mark.slow
def test_malformed_data_line_cli_one_line(tmp_path) -> None:
    data = _malformed_data(tmp_path)
    line = _one_line(_train_cli(f"data.train_files=[{data}]", TINY_CACHE, f"checkpoint.dir={tmp_path / 'run'}"))
    assert line.startswith(f"data error: {data}:2: malformed record")


@pytest.mark.slow
def test_prepare_exits_2_with_one_line_on_malformed_data(tmp_path) -> None:
    data = _malformed_data(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "app.prepare", "--config", str(ROOT / "conf/tiny.yaml"),
                           "--out", str(tmp_path / "out"), f"data.train_files=[{data}]", TINY_CACHE],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert _one_line(proc).startswith(f"data error: {data}:2: malformed record")


# Issue 22 items 4, 14, 18: hostile or broken input is one line and exit 2 from the real command line too.
CLI_CASES = [
    ("train.lr=nan", "config error: train.lr=nan is not a finite number; the DFlash default is 6e-4"),
    ("supervision.stall_timeout_s=nan",
     "config error: supervision.stall_timeout_s=nan is not a finite number; set a number > 0 seconds"),
    ("drafter.mask_token_id=-2",
     "config error: drafter.mask_token_id=-2 must be -1 (the tokenizer's mask token) or an id >= 0"),
    ("logging.run_name=${oc.env:HOME}", "config error: logging.run_name='${oc.env:HOME}' interpolates more than a "
     "${section.key} reference; resolvers such as ${oc.env:...} are refused (they copy the environment into run "
     "names and logs): write the value itself"),
    ("checkpoint.dir=s3://AKIAEXAMPLE:topsecret@bucket/run", "config error: checkpoint.dir='s3://***@bucket/run' holds "
     "credentials in the URI; remove them and set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) on "
     "every node instead"),
    ('model.target=!!python/object/apply:os.system ["echo x"]', "config error: override 'model.target=!!python/object/"
     "apply:os.system [\"echo x\"]' is not valid YAML (could not determine a constructor for the tag "
     "'tag:yaml.org,2002:python/object/apply:os.system' at line 1, column 1); fix or quote the value"),
    ("train.lr=[", "config error: override 'train.lr=[' is not valid YAML (did not find expected node content at "
     "line 2, column 1); fix or quote the value"),
]


@pytest.mark.parametrize("override, line", CLI_CASES, ids=[c[0].split("=")[0] + "=" for c in CLI_CASES])
def test_hostile_or_broken_cli_value_is_one_line(override: str, line: str, capsys, no_ray) -> None:
    got = _train_main(capsys, override)
    assert got == line
    assert "topsecret" not in got


def test_malformed_yaml_file_cli_one_line(tmp_path) -> None:
    conf = tmp_path / "bad.yaml"
    conf.write_text("model:\n  target: tiny\n train: [\n")
    proc = subprocess.run([sys.executable, "-m", "app.train", "--config", str(conf)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert _one_line(proc) == (f"config error: --config {str(conf)!r} is not valid YAML (did not find expected key "
                               "at line 3, column 2); fix the file")


@pytest.mark.slow  # reuses (or builds) the tiny target
def test_directory_named_jsonl_cli_one_line(tmp_path, capsys, no_ray) -> None:
    folder = tmp_path / "train.jsonl"
    folder.mkdir()
    line = _train_main(capsys, f"data.train_files=[{folder}]", TINY_CACHE, f"checkpoint.dir={tmp_path / 'run'}")
    assert line == f"data error: data file '{folder}' is a directory; list the files in it in data.train_files"
