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
