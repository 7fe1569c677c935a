"""Config loading and every validation case named in the foundation issue (no Ray)."""
from __future__ import annotations

import json
from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import pytest

from app.config.drafter_sections import default_gamma, default_target_layer_ids
from app.config.schema import Config, ModelConfig
from app.config.checks import (TargetInfo, actor_bundles, check_resources, check_target, read_target_info,
                               reserved_resources, resolved_mask_token_id)
from app.config.load import ConfigError, load_config
from tests.helpers import ROOT

CONF_FILES = sorted((ROOT / "conf").glob("*.yaml"))


def _tiny(*overrides: str) -> Config:
    return load_config(ROOT / "conf/tiny.yaml", list(overrides))


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        _tiny(*overrides)
    message = str(info.value)
    assert "\n" not in message  # one line, as printed by the driver
    return message


@pytest.mark.parametrize("path", CONF_FILES, ids=lambda p: p.name)
def test_every_conf_file_loads(path: Path, tmp_path: Path) -> None:
    # default.yaml names cluster paths; point them at real folders so only the schema is exercised.
    (tmp_path / "model").mkdir()
    data = tmp_path / "train.jsonl"
    data.write_text("")
    overrides = [f"model.target={tmp_path / 'model'}", f"data.train_files=[{data}]"]
    if path.name == "smol.yaml":  # its held-out prompts are written by `make smol`, absent from a fresh clone
        (tmp_path / "eval.jsonl").write_text("")
        overrides.append(f"data.eval_prompts={tmp_path / 'eval.jsonl'}")
    cfg = load_config(path, overrides)
    assert isinstance(cfg, Config)
    assert cfg.data.bucket_boundaries[-1] >= cfg.data.max_length
    if path.name == "smol.yaml":  # the real 135M target on 2 cores: 2 targets and 1 drafter fill them
        assert cfg.topology.num_targets == 2 and cfg.topology.num_drafters == 1
    else:
        assert cfg.topology.num_targets == 5 and cfg.topology.num_drafters == 3
    assert len(cfg.data.bucket_boundaries) == 6


@pytest.mark.parametrize("path", CONF_FILES, ids=lambda p: p.name)
def test_every_yaml_key_is_commented(path: Path) -> None:
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#") and ":" in line:
            assert "#" in line, f"{path.name}: key without a comment: {line!r}"


def test_tiny_is_cpu_and_needs_no_paths() -> None:
    cfg = _tiny()
    assert cfg.model.target == "tiny" and cfg.topology.device == "cpu"
    assert cfg.topology.num_targets * cfg.topology.cpus_per_target + cfg.topology.num_drafters * cfg.topology.cpus_per_drafter <= 2


def test_cli_override_wins_and_sections_are_frozen() -> None:
    cfg = _tiny("train.lr=1e-3", "data.bucket_boundaries=[10,20,30,40,50,192]")
    assert cfg.train.lr == pytest.approx(1e-3)
    assert cfg.data.bucket_boundaries == [10, 20, 30, 40, 50, 192]
    with pytest.raises(FrozenInstanceError):
        cfg.train.lr = 1.0  # type: ignore[misc]


def test_unknown_key_suggests_the_closest() -> None:
    assert _error("pool.capcity=8") == "unknown key 'pool.capcity'; did you mean 'pool.capacity'?"
    assert "did you mean 'train.grad_accum'" in _error("train.grad_acum=2")
    assert "valid keys in the top level" in _error("zzz.qqq=1") or "did you mean" in _error("zzz.qqq=1")


def test_wrong_type_names_key_value_and_type() -> None:
    msg = _error("pool.capacity=abc")
    assert msg.startswith("pool.capacity='abc' has the wrong type: expected int")
    assert "expected list[int]" in _error("data.bucket_boundaries=5")
    assert "expected float" in _error("train.lr=fast")


def test_missing_required_value() -> None:
    with pytest.raises(ConfigError, match=r"^model.target is required but not set; set it .* model.target=VALUE"):
        load_config(None, [])


SEMANTIC_CASES = [
    (["data.bucket_boundaries=[48,96,72,120,144,192]"], "data.bucket_boundaries=[48, 96, 72, 120, 144, 192] must be strictly increasing (96 then 72)"),
    (["data.bucket_boundaries=[48,48,96,120,144,192]"], "must be strictly increasing (48 then 48)"),
    (["data.bucket_boundaries=[16,32,48,64,80,96]"], "do not reach data.max_length=192; make the last boundary 192"),
    (["pool.min_ready=999", "pool.capacity=8"], "pool.min_ready=999 exceeds pool.capacity=8"),
    (["pool.jobs_in_flight_per_target=0"], "pool.jobs_in_flight_per_target=0 must be >= 1"),
    (["train.grad_accum=0"], "train.grad_accum=0 must be >= 1"),
    (["drafter.block_size=1"], "drafter.block_size=1 must be >= 2"),
    (["model.target=/no/such/model"], "model.target='/no/such/model' does not exist"),
    (["data.train_files=[/no/such.jsonl]"], "data.train_files[0]='/no/such.jsonl' does not exist"),
    (["data.eval_prompts=/no/such.jsonl"], "data.eval_prompts='/no/such.jsonl' does not exist"),
    (["topology.device=tpu"], "topology.device='tpu' is not one of auto, cuda, cpu"),
]


@pytest.mark.parametrize("overrides, expected", SEMANTIC_CASES)
def test_semantic_checks(overrides: list[str], expected: str) -> None:
    assert expected in _error(*overrides)


INFO = TargetInfo(num_layers=6, vocab_size=512, hidden_size=64, pad_token_id=0, eos_token_ids=(2,), mask_token_id=3)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["model.target_layer_ids=[1,6]"], "model.target_layer_ids=[1, 6] has 6, outside the target's 6 layers (0..5)"),
        (["model.target_layer_ids=[-1,2]"], "has -1, outside the target's 6 layers"),
        (["drafter.mask_token_id=512"], "drafter.mask_token_id=512 is outside the target's vocabulary of 512"),
        (["drafter.mask_token_id=0"], "drafter.mask_token_id=0 is the target's pad token"),
        (["drafter.mask_token_id=2"], "drafter.mask_token_id=2 is the target's eos token"),
    ],
)
def test_checks_against_the_target(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_target(_tiny(*overrides), INFO)
    assert expected in str(info.value)


def test_auto_mask_token_needs_one_in_the_tokenizer() -> None:
    check_target(_tiny(), INFO)  # -1 resolves to the tokenizer's mask token 3
    with pytest.raises(ConfigError, match="has no mask token"):
        check_target(_tiny(), replace(INFO, mask_token_id=None))


def test_more_gpus_than_the_cluster_has() -> None:
    cfg = _tiny("topology.gpus_per_target=1", "topology.gpus_per_drafter=1")
    check_resources(cfg, {"GPU": 8, "CPU": 16}, use_gpu=True)
    with pytest.raises(ConfigError, match=r"asks for 8 GPUs .* but the cluster has 4"):
        check_resources(cfg, {"GPU": 4, "CPU": 16}, use_gpu=True)
    with pytest.raises(ConfigError, match=r"asks for 1.9 CPUs .* cluster has 1"):
        check_resources(cfg, {"CPU": 1}, use_gpu=False)


def test_read_target_info_from_a_hf_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 36, "vocab_size": 151936, "hidden_size": 4096, "eos_token_id": 151645}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<|endoftext|>", "eos_token": "<|im_end|>", "added_tokens_decoder": {"151643": {"content": "<|endoftext|>"}, "151645": {"content": "<|im_end|>"}}}))
    info = read_target_info(tmp_path)
    assert (info.num_layers, info.pad_token_id, info.eos_token_ids, info.mask_token_id) == (36, 151643, (151645,), None)


def test_read_target_info_from_a_transformers_5_tokenizer(tmp_path: Path) -> None:
    """transformers 5 writes the special tokens' ids only to tokenizer.json (the tiny target's case)."""
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 6, "vocab_size": 512, "hidden_size": 64}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<pad>", "mask_token": "<|mask|>", "eos_token": "<|im_end|>"}))
    added = [{"id": 0, "content": "<pad>"}, {"id": 2, "content": "<|im_end|>"}, {"id": 3, "content": "<|mask|>"}]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    info = read_target_info(tmp_path)
    assert (info.pad_token_id, info.eos_token_ids, info.mask_token_id) == (0, (2,), 3)
    assert resolved_mask_token_id(_tiny(), info) == 3 and resolved_mask_token_id(_tiny("drafter.mask_token_id=7"), info) == 7


def test_reserved_resources_sum_the_bundles() -> None:
    topo = _tiny("topology.gpus_per_target=1", "topology.gpus_per_drafter=2").topology  # 5 targets, 3 drafters
    bundles = actor_bundles(topo, use_gpu=True)
    assert bundles[0] == {"CPU": topo.cpus_per_target, "GPU": 1} and bundles[-1] == {"CPU": topo.cpus_per_drafter, "GPU": 2}
    cpus = 5 * topo.cpus_per_target + 3 * topo.cpus_per_drafter
    assert reserved_resources(topo, use_gpu=True) == pytest.approx({"CPU": cpus, "GPU": 11})
    assert reserved_resources(topo, use_gpu=False) == pytest.approx({"CPU": cpus, "GPU": 0})


def test_dflash_defaults() -> None:
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    assert ModelConfig(target="x").target_layer_ids == []


@pytest.mark.parametrize(
    "overrides, needle",
    [(["pool.min_ready=999", "pool.capacity=8"], "pool.min_ready"), (["pool.capcity=8"], "did you mean 'pool.capacity'?")],
)
def test_train_cli_exits_2_with_one_line(overrides: list[str], needle: str, capsys) -> None:
    """`app.train.main` in this process (tests/test_user_errors.py runs the real command line for the exit code)."""
    from app.train import main

    assert main(["--config", str(ROOT / "conf/tiny.yaml"), *overrides]) == 2
    captured = capsys.readouterr()
    lines = [l for l in (captured.out + captured.err).splitlines() if l.strip()]
    assert len(lines) == 1 and needle in lines[0], lines


# Keys whose conf/default.yaml value deliberately differs from the schema default: default.yaml is an
# example for one Qwen3-8B run on one node, the schema is target-agnostic.
DEFAULT_YAML_EXCEPTIONS = {
    "model.target": "required: the schema has no default target (MISSING), the YAML names a Qwen3-8B path",
    "data.train_files": "the schema's [] means 'generated' with model.target=tiny; the YAML names a cluster path",
    "drafter.mask_token_id": "the schema's -1 takes the tokenizer's mask token; 151669 is a Qwen3-specific row",
}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_schema_defaults_equal_default_yaml() -> None:
    import dataclasses

    import yaml

    schema = _flat(dataclasses.asdict(Config()))
    yaml_values = _flat(yaml.safe_load((ROOT / "conf/default.yaml").read_text()))
    assert sorted(schema) == sorted(yaml_values), "default.yaml and the schema list different keys"
    differ = {k: (schema[k], yaml_values[k]) for k in schema if schema[k] != yaml_values[k]}
    assert set(differ) == set(DEFAULT_YAML_EXCEPTIONS), differ


# One bad value per section check: (override, the message's start). Each is a ValueError raised by the
# section's __post_init__ during to_object, and must reach the user as one ConfigError line naming the key.
SECTION_CASES = [
    ("model.dtype=fp8", "model.dtype='fp8' is not one of bfloat16, float16, float32"),
    ("tiny.hidden_size=66", "tiny.hidden_size=66 must be a multiple of tiny.num_heads=4"),
    ("tiny.chain_top_prob=0.5", "tiny.chain_top_prob=0.5 must be in (0.5, 1]"),
    ("tiny.vocab_size=20", "tiny.vocab_size=20 is too small"),
    ("topology.num_targets=0", "topology.num_targets=0 must be >= 1"),
    ("topology.cpus_per_drafter=-1", "topology.cpus_per_drafter=-1.0 must be >= 0"),
    ("topology.strategy=STRICT", "topology.strategy='STRICT' is not one of PACK, SPREAD"),
    ("data.format=csv", "data.format='csv' is not one of auto, openai, sharegpt, tokenized"),
    ("data.on_error=ignore", "data.on_error='ignore' is not one of raise, skip"),
    ("data.tokens_per_job=0", "data.tokens_per_job=0 must be >= 1"),
    ("data.bucket_boundaries=[]", "data.bucket_boundaries=[] is empty"),
    ("data.bucket_boundaries=[0,48,72,96,120,192]", "data.bucket_boundaries=[0, 48, 72, 96, 120, 192] must be positive"),
    ("pool.capacity=0", "pool.capacity=0 must be >= 1"),
    ("pool.min_ready=-1", "pool.min_ready=-1 must be >= 0"),
    ("pool.capacity_bytes=0", "pool.capacity_bytes=0 must be >= 1"),
    ("drafter.num_anchors=0", "drafter.num_anchors=0 must be >= 1"),
    ("drafter.loss_gamma=-1", "drafter.loss_gamma=-1.0 must be >= 0"),
    ("train.epochs=0", "train.epochs=0 must be >= 1"),
    ("health.collapse_top_share=1.5", "health.collapse_top_share=1.5 must be in [0, 1] (a share)"),
    ("health.fit_min_tau=0.5", "health.fit_min_tau=0.5 must be >= 1.0"),
    ("train.lr=0", "train.lr=0.0 must be > 0"),
    ("train.warmup_ratio=1", "train.warmup_ratio=1.0 must be in [0, 1)"),
    ("checkpoint.keep=0", "checkpoint.keep=0 must be >= 1"),
    ("logging.wandb_mode=cloud", "logging.wandb_mode='cloud' is not one of offline, online, disabled"),
    ("logging.status_every_s=0", "logging.status_every_s=0.0 must be > 0 seconds"),
    ("supervision.max_restarts_target=-1", "supervision.max_restarts_target=-1 must be >= 0"),
    ("supervision.stall_timeout_s=0", "supervision.stall_timeout_s=0.0 must be > 0 seconds"),
    ("eval.max_new_tokens=0", "eval.max_new_tokens=0 must be >= 1"),
    ("data.max_length=10", "data.max_length=10 is shorter than 2 x drafter.block_size=8"),
]


@pytest.mark.parametrize("override, start", SECTION_CASES, ids=[c[0] for c in SECTION_CASES])
def test_each_section_check_reaches_the_user_as_one_line(override: str, start: str) -> None:
    from omegaconf import OmegaConf

    assert _error(override).startswith(start)
    # The loader adds no check of its own: building the section (or the tree) directly raises the same.
    key = override.split("=", 1)[0]
    section, name = key.split(".")
    value = OmegaConf.to_container(OmegaConf.from_dotlist([override]))[section][name]
    cfg = _tiny()
    with pytest.raises(ValueError) as info:
        replace(cfg, **{section: replace(getattr(cfg, section), **{name: value})})
    assert str(info.value).startswith(f"{key}=") and "\n" not in str(info.value)


def test_wrong_shapes_name_the_key() -> None:
    assert _error("pool=5").startswith("pool=5 has the wrong type: expected a section (mapping of keys)")
    assert _error("data.bucket_boundaries={a: 1}").startswith(
        "data.bucket_boundaries={'a': 1} has the wrong type: expected list[int]")
    assert _error("data.bucket_boundaries=[a]").startswith("data.bucket_boundaries[0]='a' has the wrong type: expected int")
    assert _error("pool.capacity.x=1").startswith("pool.capacity={'x': 1} has the wrong type: expected int")
    assert _error("zzz.qqq=1").startswith("unknown key 'zzz'; valid keys in the top level: model, tiny")


@pytest.mark.parametrize(
    "overrides, expected",
    SEMANTIC_CASES + [([override], start) for override, start in SECTION_CASES],
)
def test_every_config_case_exits_2_with_one_line(overrides: list[str], expected: str, capsys) -> None:
    from app.train import main

    assert main(["--config", str(ROOT / "conf/tiny.yaml"), *overrides]) == 2
    captured = capsys.readouterr()
    lines = [l for l in (captured.out + captured.err).splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("config error: ") and expected in lines[0], lines


@pytest.mark.parametrize(
    "ids, expected",
    [
        ("[1,5]", "model.target_layer_ids=[1, 5] has 5, the target's last layer"),
        ("[3,1]", "model.target_layer_ids=[3, 1] is not ascending: vLLM and SGLang sort the ids"),
        ("[1,3,3]", "model.target_layer_ids=[1, 3, 3] repeats layer 3: vLLM and SGLang fail"),
    ],
)
def test_layer_ids_engines_misread_are_refused(ids: str, expected: str) -> None:
    """Issue 25: last layer, non-ascending, repeated ids load into the engines wrong or not at all."""
    with pytest.raises(ConfigError) as info:
        check_target(_tiny(f"model.target_layer_ids={ids}"), INFO)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_layer_ids_default_spread_is_checked_too() -> None:
    # 6 target layers, 5 draft layers: DFlash's spread repeats ids; the line says where they came from.
    with pytest.raises(ConfigError, match=r"the DFlash default for a 6-layer target and drafter.num_layers=5 is "
                                          r"\[1, 2, 2, 2, 3\]\) repeats layer 2"):
        check_target(_tiny("drafter.num_layers=5"), INFO)
    for ids in ("[1,3]", "[0,4]", "[]"):  # fine: ascending, distinct, below the last layer
        check_target(_tiny(f"model.target_layer_ids={ids}"), INFO)


@pytest.mark.parametrize("overrides,fragment", [
    (("topology.gpus_per_drafter=0.5", "topology.num_drafters=2"),
     "topology.gpus_per_drafter=0.5 with topology.num_drafters=2: Ray can pack two drafter ranks onto one GPU"),
    (("topology.gpus_per_drafter=0.25", "topology.num_drafters=1", "topology.rebalance=auto"),
     "topology.gpus_per_drafter=0.25 with topology.rebalance=auto"),
    (("topology.gpus_per_drafter=1.5",), "topology.gpus_per_drafter=1.5 is above 1 but not whole"),
])
def test_two_drafter_ranks_on_one_gpu_are_refused_before_any_actor(overrides, fragment) -> None:
    """Issue 37 item 1: fractional drafter GPUs with two or more ranks on an 8-GPU node; NCCL would refuse
    the shared device at the first collective, after the targets loaded. One line, with the fix."""
    cfg = _tiny("topology.gpus_per_target=0.5", *overrides)
    with pytest.raises(ConfigError) as info:
        check_resources(cfg, {"GPU": 8, "CPU": 64}, use_gpu=True)
    msg = str(info.value)
    assert fragment in msg and "\n" not in msg
    assert ("NCCL" in msg and "set topology.gpus_per_drafter=1" in msg) or "give a whole number" in msg
    check_resources(cfg, {"GPU": 8, "CPU": 64}, use_gpu=False)  # a CPU run reserves no GPU: gloo, no clash


def test_fractional_gpus_are_fine_for_one_drafter_and_for_targets() -> None:
    one = _tiny("topology.gpus_per_target=0.5", "topology.gpus_per_drafter=0.5", "topology.num_drafters=1")
    check_resources(one, {"GPU": 8, "CPU": 64}, use_gpu=True)  # one rank: no NCCL peer on its device
    whole = _tiny("topology.gpus_per_target=0.5", "topology.gpus_per_drafter=1", "topology.num_drafters=3")
    check_resources(whole, {"GPU": 8, "CPU": 64}, use_gpu=True)


def test_a_target_over_several_gpus_needs_a_whole_number_and_accelerate() -> None:
    """Issue 37 item 2: gpus_per_target > 1 spreads the target's layers over its bundle's GPUs (accelerate)."""
    from app.config.checks import check_target_gpus

    check_resources(_tiny("topology.gpus_per_target=2", "topology.gpus_per_drafter=1"), {"GPU": 16, "CPU": 64},
                    use_gpu=True)
    with pytest.raises(ConfigError, match=r"topology.gpus_per_target=1.5 is above 1 but not whole.*e.g. 1 or 2"):
        check_resources(_tiny("topology.gpus_per_target=1.5"), {"GPU": 16, "CPU": 64}, use_gpu=True)
    with pytest.raises(ConfigError, match="pip install accelerate, or set topology.gpus_per_target=1"):
        check_target_gpus(2, accelerate=False)
    check_target_gpus(0.5, accelerate=False)  # a share of one GPU loads on it whole
