"""What a first GPU run needs, checked on CPU (issue 23): config refusals and kernel choices."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from app.config.checks import TargetInfo, check_target, read_target_info
from app.config.errors import ConfigError
from app.config.load import load_config

ROOT = Path(__file__).resolve().parents[1]
INFO = TargetInfo(num_layers=6, vocab_size=512, hidden_size=64, pad_token_id=0, eos_token_ids=(2,), mask_token_id=3,
                  head_dim=8)


def test_a_head_dim_below_16_is_refused_on_cuda_in_one_line():
    """Item 2: compiled flex_attention on CUDA refuses head_dim < 16; the run says so before any actor."""
    on_gpu = load_config(ROOT / "conf/tiny.yaml", ["topology.device=cuda", "topology.gpus_per_drafter=1"])
    with pytest.raises(ConfigError) as e:
        check_target(on_gpu, INFO)
    msg = str(e.value)
    assert "\n" not in msg and "head_dim=8" in msg and ">= 16" in msg and "topology.device=cpu" in msg
    check_target(on_gpu, replace(INFO, head_dim=16))  # 16 is fine
    check_target(load_config(ROOT / "conf/tiny.yaml", []), INFO)  # CPU: the tiled kernel takes any width


def test_head_dim_is_read_from_the_target_folder(tmp_path):
    cfg = {"num_hidden_layers": 2, "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert read_target_info(tmp_path).head_dim == 8  # hidden // heads when head_dim is absent
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"head_dim": 128}))
    assert read_target_info(tmp_path).head_dim == 128
