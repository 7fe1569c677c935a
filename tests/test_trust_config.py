"""Trust on a shared cluster, the config and input half (issue 22, items 4, 14 and 18): non-finite
numbers, credentials in URIs and in the environment, and hostile or broken input each end in one
line (or a counted skip), never a traceback, a NaN run or a leaked secret. Fast, no Ray."""
from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import replace
from pathlib import Path

import pytest

from app.config.errors import ConfigError
from app.config.load import load_config
from app.config.schema import Config, DataConfig
from app.data.records import DataError
from app.storage.roots import has_credentials, redact
from tests.helpers import ROOT

SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"  # AWS's documented example secret: '/' and '+' included


def _error(*overrides: str, path: Path | None = ROOT / "conf/tiny.yaml") -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    message = str(info.value)
    assert "\n" not in message  # one line, as printed by the driver
    return message


def _float_keys() -> list[str]:
    """Every float field of every section, found from the schema (a new one is covered by itself)."""
    sections = {k: v for k, v in typing.get_type_hints(Config).items() if dataclasses.is_dataclass(v)}  # not runs: a list
    return [f"{name}.{key}" for name, section in sections.items()
            for key, tp in typing.get_type_hints(section).items() if tp is float]


# ---- item 4: nan and inf ---------------------------------------------------------------------


def test_the_schema_has_the_float_keys_this_file_covers() -> None:
    keys = _float_keys()
    assert {"train.lr", "train.max_grad_norm", "supervision.stall_timeout_s", "supervision.stop_timeout_s",
            "drafter.loss_gamma", "pool.metrics_every_s", "topology.gpus_per_target"} <= set(keys)
    assert len(keys) >= 15, keys


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", _float_keys())
def test_every_float_key_refuses_non_finite_values(key: str, value: str) -> None:
    message = _error(f"{key}={value}")
    assert message.startswith(f"{key}=")
    # Range checks ((0.5, 1], [0, 1)) fail nan by themselves; every other check says it is not finite.
    assert "finite number" in message or "must be in" in message, message
    section, name = key.split(".")
    cfg = load_config(ROOT / "conf/tiny.yaml")
    with pytest.raises(ValueError, match=rf"^{key}="):  # built directly, the section refuses it too
        replace(getattr(cfg, section), **{name: float(value)})


def test_nan_lr_and_nan_stall_timeout_name_the_fix() -> None:
    assert _error("train.lr=nan") == "train.lr=nan is not a finite number; the DFlash default is 6e-4"
    assert _error("train.lr=1e999") == "train.lr=inf is not a finite number; the DFlash default is 6e-4"  # overflows
    assert _error("supervision.stall_timeout_s=nan") == (
        "supervision.stall_timeout_s=nan is not a finite number; set a number > 0 seconds")


def test_yaml_nan_in_a_config_file_is_refused(tmp_path: Path) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text("model: {target: tiny}\ntrain: {lr: .nan}\nsupervision: {stop_timeout_s: .inf}\n")
    assert _error(path=conf).startswith("train.lr=nan is not a finite number")
    assert _error("train.lr=1e-3", path=conf).startswith("supervision.stop_timeout_s=inf is not a finite number")


def test_finite_values_still_load() -> None:
    cfg = load_config(ROOT / "conf/tiny.yaml", ["train.lr=1e-3", "train.max_grad_norm=0.5", "drafter.loss_gamma=0"])
    assert (cfg.train.lr, cfg.train.max_grad_norm, cfg.drafter.loss_gamma) == (1e-3, 0.5, 0.0)
    assert all(math.isfinite(v) for v in (cfg.supervision.stall_timeout_s, cfg.supervision.stop_timeout_s))


# ---- item 14: credentials ----------------------------------------------------------------------


@pytest.mark.parametrize("text, shown", [
    ("s3://AKIAEXAMPLE:SECRET@bucket/run", "s3://***@bucket/run"),
    (f"s3://AKIAEXAMPLE:{SECRET}@bucket/run?endpoint_override=h:9000", "s3://***@bucket/run?endpoint_override=h:9000"),
    ("s3://TOKEN@bucket/run", "s3://***@bucket/run"),
    ("s3://b/r?access_key=A&secret_key=S&session_token=T&scheme=http",
     "s3://b/r?access_key=***&secret_key=***&session_token=***&scheme=http"),
    ("resuming from s3://K:S@b/run/ckpt-00000004/v-1 (step 4) and gs://u:p@q/x", "resuming from s3://***@b/run/ckpt-00000004/v-1 (step 4) and gs://***@q/x"),
])
def test_redact_hides_userinfo_and_secret_query_options(text: str, shown: str) -> None:
    assert redact(text) == shown and has_credentials(text)
    assert redact(shown) == shown  # idempotent: a redacted line passes through unchanged


@pytest.mark.parametrize("text", [
    "runs/qwen3-8b", "/shared/runs/a@b", "s3://bucket/run@v2", "file:///tmp/run",
    "s3://bucket/run?endpoint_override=127.0.0.1:9000&scheme=http&region=us-east-1",
])
def test_redact_leaves_locations_without_credentials_alone(text: str) -> None:
    assert redact(text) == text and not has_credentials(text)


@pytest.mark.parametrize("uri", [f"s3://AKIAEXAMPLE:{SECRET}@bucket/run", f"s3://bucket/run?secret_key={SECRET}"])
def test_checkpoint_uri_with_credentials_is_refused_without_echoing_them(uri: str) -> None:
    message = _error(f"checkpoint.dir={uri}")
    assert message.startswith("checkpoint.dir='s3://") and "holds credentials in the URI" in message
    assert "AWS_ACCESS_KEY_ID" in message and "AWS_SECRET_ACCESS_KEY" in message
    assert SECRET not in message and "AKIAEXAMPLE" not in message


def test_entry_point_prints_the_refusal_without_the_secret(capsys) -> None:
    from app.train import main

    assert main(["--config", str(ROOT / "conf/tiny.yaml"), f"checkpoint.dir=s3://AKIAEXAMPLE:{SECRET}@b/r"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("config error: checkpoint.dir='s3://***@b/r'")
    assert SECRET not in err


def test_driver_log_and_error_lines_are_redacted(capsys) -> None:
    from app.run.driver import log

    log(f"exported drafter to s3://AKIAEXAMPLE:{SECRET}@b/r/drafter")
    out = capsys.readouterr().out
    assert out.rstrip().endswith("exported drafter to s3://***@b/r/drafter") and SECRET not in out


@pytest.mark.parametrize("value", ["${oc.env:DFLASH_TEST_SECRET}", "x-${oc.env:DFLASH_TEST_SECRET,none}",
                                   "${oc.decode:'1'}", "${a.${oc.env:DFLASH_TEST_SECRET}}", "${.run_name}"])
def test_resolvers_are_refused_on_the_command_line(value: str, monkeypatch) -> None:
    monkeypatch.setenv("DFLASH_TEST_SECRET", SECRET)
    message = _error(f"logging.run_name={value}")
    assert message.startswith(f"logging.run_name={value!r} interpolates more than a ${{section.key}} reference")
    assert SECRET not in message


def test_resolvers_are_refused_in_a_config_file_with_their_key(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DFLASH_TEST_SECRET", SECRET)
    conf = tmp_path / "c.yaml"
    conf.write_text("model: {target: tiny}\ndata:\n  train_files: ['${oc.env:DFLASH_TEST_SECRET}']\n")
    assert _error(path=conf).startswith("data.train_files[0]='${oc.env:DFLASH_TEST_SECRET}' interpolates")


def test_plain_section_key_references_still_resolve() -> None:
    cfg = load_config(ROOT / "conf/tiny.yaml", ["checkpoint.dir=/tmp/run7", "logging.run_name=${checkpoint.dir}-a"])
    assert cfg.logging.run_name == "/tmp/run7-a"


# ---- item 18: broken and hostile input ---------------------------------------------------------


@pytest.mark.parametrize("text, where", [
    ("model:\n  target: tiny\n train: [\n", "did not find expected key at line 3, column 2"),
    ("\t- x\n", "found character that cannot start any token at line 1, column 1"),
    ("a: " + "[" * 20000 + "]" * 20000 + "\n", "exceeded maximum nesting depth"),
])
def test_malformed_yaml_file_is_one_line_with_its_place(tmp_path: Path, text: str, where: str) -> None:
    conf = tmp_path / "bad.yaml"
    conf.write_text(text)
    message = _error(path=conf)
    assert message.startswith(f"--config {str(conf)!r} is not valid YAML (") and where in message, message


def test_python_tags_are_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    conf = tmp_path / "tag.yaml"
    conf.write_text(f'model:\n  target: !!python/object/apply:os.system ["touch {marker}"]\n')
    assert "could not determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply:os.system'" in \
        _error(path=conf)
    message = _error(f'model.target=!!python/object/apply:os.system ["touch {marker}"]')
    assert message.startswith("override 'model.target=!!python/object/apply:os.system") and "not valid YAML" in message
    assert not marker.exists()


@pytest.mark.parametrize("override, where", [
    ("train.lr=[", "did not find expected node content"),
    ('logging.run_name="x', "found unexpected end of stream"),
    ("logging.run_name=a: b: c", "mapping values are not allowed in this context at line 1, column 5"),
])
def test_malformed_cli_value_names_the_override(override: str, where: str) -> None:
    message = _error(override)
    assert message.startswith(f"override {override!r} is not valid YAML (") and where in message, message


def test_only_minus_one_means_auto_mask_token() -> None:
    assert _error("drafter.mask_token_id=-2") == (
        "drafter.mask_token_id=-2 must be -1 (the tokenizer's mask token) or an id >= 0")
    assert load_config(ROOT / "conf/tiny.yaml", ["drafter.mask_token_id=-1"]).drafter.mask_token_id == -1
    assert load_config(ROOT / "conf/tiny.yaml", ["drafter.mask_token_id=7"]).drafter.mask_token_id == 7


def _records(tmp_path: Path, *bad: str) -> str:
    """A JSONL file: a good pre-tokenized record, then the `bad` lines."""
    good = json.dumps({"input_ids": list(range(1, 21)), "loss_mask": [0] * 4 + [1] * 16})
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join([good, *bad]) + "\n")
    return str(path)


BOOL_ID = json.dumps({"input_ids": [1, True] + list(range(3, 21)), "loss_mask": [0] * 4 + [1] * 16})
DEEP = '{"input_ids": ' + "[" * 100_000 + "]" * 100_000 + ', "loss_mask": []}'


@pytest.mark.parametrize("bad, reason", [(BOOL_ID, "input_ids must be non-negative ints"),
                                         (DEEP, "JSON nested too deeply")], ids=["json-true-id", "deep-json"])
def test_bad_records_are_one_line_or_a_counted_skip(tmp_path: Path, bad: str, reason: str) -> None:
    from app.data.dataset import load_dataset

    path = _records(tmp_path, bad)
    data = replace(DataConfig(), format="tokenized", max_length=64, bucket_boundaries=[32, 64])
    with pytest.raises(DataError) as info:
        load_dataset(replace(data, on_error="raise"), 2, None, [path])
    assert str(info.value).startswith(f"{path}:2: malformed record: {reason}") and "\n" not in str(info.value)
    ds = load_dataset(replace(data, on_error="skip"), 2, None, [path])
    assert len(ds) == 1 and ds.lengths().tolist() == [20]
    assert ds.summary.total().dropped["malformed"] == 1


def test_a_directory_named_jsonl_is_one_line(tmp_path: Path) -> None:
    from app.data.dataset import load_dataset

    folder = tmp_path / "train.jsonl"
    folder.mkdir()
    with pytest.raises(DataError, match=rf"^data file '{folder}' is a directory; list the files in it"):
        load_dataset(replace(DataConfig(), format="tokenized"), 2, None, [str(folder)])
