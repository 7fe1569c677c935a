"""The `runs:` list (app/config/sweep_section.py): each run's own config, and one line per mistake."""
from __future__ import annotations

import pytest

from app.config.load import ConfigError, load_config
from app.config.sweep_section import run_config, run_folder, sweep_drafters

TWO = "runs=[{name: d1, drafter: {num_layers: 1}}, {name: lr3, train: {lr: 1e-3}, drafters: 2}]"


def test_each_run_gets_its_overrides_drafters_and_folder():
    cfg = load_config("conf/tiny.yaml", [TWO, "checkpoint.dir=/tmp/sweep"])
    d1, lr3 = (run_config(cfg, r) for r in cfg.runs)
    assert d1.drafter.num_layers == 1 and d1.train.lr == cfg.train.lr and d1.topology.num_drafters == 3
    assert lr3.drafter == cfg.drafter and lr3.train.lr == 1e-3 and lr3.topology.num_drafters == 2
    assert (d1.checkpoint.dir, lr3.checkpoint.dir) == ("/tmp/sweep/runs/d1", "/tmp/sweep/runs/lr3")
    assert d1.runs == [] and sweep_drafters(cfg) == 5
    assert load_config("conf/tiny.yaml").runs == [] and sweep_drafters(load_config("conf/tiny.yaml")) == 3


def test_a_uri_keeps_its_query_at_the_end():
    assert run_folder("s3://b/x?scheme=http", "a") == "s3://b/x/runs/a?scheme=http"


@pytest.mark.parametrize("override, says", [
    ("runs=[{name: a}, {name: a}]", "name 'a' more than once"),
    ("runs=[{name: '../x'}]", "names a folder"),
    ("runs=[{name: a, train: {epochs: 2}}]", "may not set 'epochs'"),
    ("runs=[{name: a, drafter: {depth: 1}}]", "has no key 'depth'"),
    ("runs=[{name: a, train: {lr: -1}}]", "runs[a].train.lr=-1 must be > 0"),
    ("runs=[{name: a, drafter: {block_size: 4096}}]", "runs[a].drafter.block_size=4096 needs data.max_length"),
    ("runs=[{name: a, drafters: -1}]", "runs[a].drafters=-1"),
])
def test_a_bad_run_is_one_line_naming_it(override, says):
    with pytest.raises(ConfigError, match=None) as exc:
        load_config("conf/tiny.yaml", [override])
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_several_runs_refuse_automatic_resplits():
    with pytest.raises(ConfigError, match="topology.rebalance"):
        load_config("conf/tiny.yaml", ["runs=[{name: a}, {name: b}]", "topology.rebalance=auto"])


# -- each run's target layers get every check model.target_layer_ids gets (app/config/layer_checks.py) --------------

SIX = dict(num_layers=6, vocab_size=512, hidden_size=64, pad_token_id=0, eos_token_ids=(2,), mask_token_id=3)


def _refusal(*overrides: str) -> str:
    from app.config.checks import TargetInfo, check_target

    with pytest.raises(ConfigError) as exc:
        check_target(load_config("conf/tiny.yaml", list(overrides)), TargetInfo(**SIX))
    assert "\n" not in str(exc.value)
    return str(exc.value)


@pytest.mark.parametrize("ids", ["[3, 1]", "[1, 5]", "[1, 3, 3]", "[1, 9]"])
def test_a_runs_layers_are_refused_as_the_single_runs_are(ids):
    """Out of order, the target's last layer, repeated, outside the target: the same line as for
    model.target_layer_ids, naming runs[<name>].target_layer_ids (a single run's line, key replaced)."""
    single = _refusal(f"model.target_layer_ids={ids}")
    swept = _refusal(f"runs=[{{name: ok}}, {{name: wide, target_layer_ids: {ids}}}]")
    assert swept == single.replace("model.target_layer_ids=", "runs[wide].target_layer_ids="), (swept, single)


def test_the_refusals_say_what_the_engines_would_do():
    assert _refusal("runs=[{name: a, target_layer_ids: [3, 1]}]") == (
        "runs[a].target_layer_ids=[3, 1] is not ascending: vLLM and SGLang sort the ids, so the features would reach "
        "fc permuted against training; write them as [1, 3]")
    assert _refusal("runs=[{name: a, target_layer_ids: [1, 5]}]") == (
        "runs[a].target_layer_ids=[1, 5] has 5, the target's last layer: training reads its hidden state after the "
        "final norm, vLLM before it (silently wrong features), SGLang refuses it and the speculators converter drops "
        "it; list distinct ascending ids below the last layer (at most 4)")


def test_a_runs_default_layers_are_checked_for_its_own_depth():
    # 6 target layers: DFlash's spread for a 5-layer drafter repeats ids; the root's 2-layer one is fine.
    assert _refusal("runs=[{name: ok}, {name: deep, drafter: {num_layers: 5}}]").startswith(
        "runs[deep].target_layer_ids=[] (the DFlash default for a 6-layer target and runs[deep].drafter.num_layers=5 "
        "is [1, 2, 2, 2, 3]) repeats layer 2")


def test_runs_with_layers_the_engines_read_as_trained_pass():
    from app.config.checks import TargetInfo, check_target

    cfg = load_config("conf/tiny.yaml", ["runs=[{name: a}, {name: b, target_layer_ids: [0, 4]}, "
                                         "{name: c, drafter: {num_layers: 1}}]"])
    check_target(cfg, TargetInfo(**SIX))


def test_a_bad_runs_layers_stop_the_command_line_before_any_actor(capsys, monkeypatch):
    """`app.train.main` on the sweep conf: exit 2 with the one line, and Ray never asked for."""
    import ray

    from app.train import main

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init before the layers were checked"))
    assert main(["--config", "conf/tiny-sweep.yaml",
                 "runs=[{name: a}, {name: wide, target_layer_ids: [3, 1]}]"]) == 2
    out = capsys.readouterr()
    # A fresh clone builds the tiny target first (its progress bars); the refusal is one line, the last.
    lines = [line for line in (out.out + out.err).splitlines() if line.strip() and "model shards" not in line]
    assert len(lines) == 1 and "runs[wide].target_layer_ids=[3, 1] is not ascending" in lines[0], lines
