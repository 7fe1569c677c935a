"""From a run's drafter/ to a serving engine (issue 25): launch lines, bf16 export, speculators folder, speed estimate."""
from __future__ import annotations

import json
import shlex
from types import SimpleNamespace

import pytest
import torch

from app.config.run_sections import CheckpointConfig
from app.model.drafter import DFlashDrafter
from app.model.export import export_drafter, export_dtype, load_drafter
from app.model.engines import cost_ratio, launch_lines, num_speculative_tokens, speed_estimate, speculators_config
from app.run.outputs.run_outputs import print_serving, serving_outputs
from tests.toy import save_tiny_target, tiny_arch, tiny_qwen3_config

BLOCK = 4


@pytest.fixture
def run(tmp_path):
    """A run folder with a bf16 drafter/ exported as the drafter actor does, and a saved tiny target."""
    torch.manual_seed(0)
    target = tmp_path / "target with space"
    save_tiny_target(target)
    arch = tiny_arch(tiny_qwen3_config(), num_layers=2, block_size=BLOCK, target_layer_ids=(0, 2), mask_token_id=7)
    drafter = DFlashDrafter(arch).eval()
    root = tmp_path / "run"
    export = export_drafter(drafter, arch, root / "drafter", dtype=export_dtype(CheckpointConfig().export_dtype))
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(dir=str(root)), drafter=SimpleNamespace(block_size=BLOCK))
    return cfg, str(target), str(export), drafter, arch


def test_printed_launch_lines_carry_the_real_path_and_block_size_minus_one(run):
    cfg, target, export, _, _ = run
    summary = serving_outputs(cfg, target, export, tau=3.0, log=lambda _: None)
    printed: list[str] = []
    print_serving(summary, printed.append)
    vllm = next(line for line in printed if line.startswith("serve with vllm: "))
    argv = shlex.split(vllm.removeprefix("serve with vllm: "))  # what a shell would pass
    assert argv[:3] == ["vllm", "serve", target]
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": export, "num_speculative_tokens": BLOCK - 1}
    sglang = shlex.split(next(line for line in printed if line.startswith("serve with sglang: ")).split(": ", 1)[1])
    assert sglang[sglang.index("--speculative-draft-model-path") + 1] == export
    assert sglang[sglang.index("--model-path") + 1] == target
    assert sglang[sglang.index("--speculative-algorithm") + 1] == "DFLASH"
    assert sglang[sglang.index("--dtype") + 1] == "bfloat16"
    assert summary["serve"]["vllm"] == vllm.removeprefix("serve with vllm: ")  # the same lines in summary.json


def test_num_speculative_tokens_uses_the_whole_trained_block():
    assert num_speculative_tokens(16) == 15
    assert '"num_speculative_tokens": 9' in launch_lines("/m", "/r/drafter", 10)["vllm"]


def test_export_is_bf16_by_default_and_fp32_stays_selectable(run, tmp_path):
    from safetensors import safe_open

    _, _, export, drafter, arch = run
    assert CheckpointConfig().export_dtype == "bfloat16"
    with safe_open(f"{export}/model.safetensors", framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads(open(f"{export}/config.json").read())["dtype"] == "bfloat16"
    again, _ = load_drafter(export, dtype=torch.float32)
    for (name, a), b in zip(drafter.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16).float(), b), name  # exactly the weights rounded to bf16
    fp32 = export_drafter(drafter, arch, tmp_path / "fp32", dtype=export_dtype("float32"))
    with safe_open(f"{fp32}/model.safetensors", framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
    with pytest.raises(ValueError, match="checkpoint.export_dtype='int8' is not one of bfloat16, float16, float32"):
        CheckpointConfig(export_dtype="int8")


def test_speculators_folder_beside_the_export(run):
    cfg, target, export, _, arch = run
    summary = serving_outputs(cfg, target, export, tau=None, log=lambda _: None)
    spec_dir = f"{cfg.checkpoint.dir}/drafter-speculators"
    spec = json.loads(open(f"{spec_dir}/config.json").read())
    assert spec["speculators_model_type"] == "dflash" and spec["block_size"] == BLOCK
    # The format numbers hidden states from the embeddings: trained layers (0, 2) are 1 and 3 to its readers.
    assert spec["aux_hidden_state_layer_ids"] == [1, 3]
    assert spec["eagle_aux_hidden_state_layer_ids"] == [1, 3]
    methods = spec["speculators_config"]["proposal_methods"]
    assert methods == [{"proposal_type": "greedy", "speculative_tokens": BLOCK - 1}]
    assert spec["speculators_config"]["verifier"]["architectures"] == ["Qwen3ForCausalLM"]
    assert spec["transformer_layer_config"]["num_hidden_layers"] == 2 and spec["mask_token_id"] == 7
    assert open(f"{spec_dir}/model.safetensors", "rb").read() == open(f"{export}/model.safetensors", "rb").read()
    assert json.loads(shlex.split(summary["serve"]["vllm_speculators"])[-1]) == {
        "method": "dflash", "model": spec_dir, "num_speculative_tokens": BLOCK - 1}
    assert summary["serving_estimate"] is None  # no tau measured: no estimate, not a made-up one


def test_speed_estimate_formula_and_ratio(run):
    cfg, target, export, _, arch = run
    est = speed_estimate(4.0, 4.0)
    assert est["speedup"] == pytest.approx(3.2) and est["formula"] == "speedup = tau / (1 + 1 / ratio)"
    assert speed_estimate(1.0, 1.0)["speedup"] == pytest.approx(0.5)  # an untrained drafter is a slowdown
    assert speed_estimate(None, 4.0) is None
    # Parameters read per forward: the fp32 tiny target (all its weights) against the bf16 drafter + LM head.
    target_params = sum(p.numel() for p in save_tiny_target(f"{cfg.checkpoint.dir}/t2").parameters())
    drafter_params = sum(p.numel() for p in DFlashDrafter(arch).parameters()) + arch.vocab_size * arch.hidden_size
    assert cost_ratio(target, export, arch.vocab_size, arch.hidden_size) == pytest.approx(target_params / drafter_params)
    summary = serving_outputs(cfg, target, export, tau=2.5, log=lambda _: None)
    assert summary["serving_estimate"]["ratio"] == pytest.approx(target_params / drafter_params)
    assert summary["serving_estimate"]["tau"] == 2.5


def test_speculators_config_from_the_export_config(run):
    _, _, export, _, _ = run
    hf = json.loads(open(f"{export}/config.json").read())
    spec = speculators_config(hf, "/models/x", ["Qwen3ForCausalLM"])
    assert "dflash_ray_arch" not in spec["transformer_layer_config"]
    assert spec["transformer_layer_config"]["is_causal"] is False
    assert spec["draft_vocab_size"] == hf["vocab_size"] and spec["target_hidden_size"] == hf["hidden_size"]


def test_uri_run_gets_its_speculators_folder_uploaded(run, tmp_path):
    """A URI checkpoint.dir (file:// here, the same UriStorage path as s3://): the folder is uploaded beside drafter/."""
    from pathlib import Path

    from app.storage.roots import open_storage

    _, target, export, _, _ = run
    root = (tmp_path / "bucket").as_uri()
    location = open_storage(root).upload_dir(Path(export), "drafter", last="config.json")
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(dir=root), drafter=SimpleNamespace(block_size=BLOCK))
    summary = serving_outputs(cfg, target, location, tau=2.0, log=lambda _: None)
    spec = json.loads((tmp_path / "bucket" / "drafter-speculators" / "config.json").read_text())
    assert spec["eagle_aux_hidden_state_layer_ids"] == [1, 3]
    assert json.loads(shlex.split(summary["serve"]["vllm"])[-1])["model"] == location
    # The estimate is read from the downloaded export too (it was null for every URI run).
    local = serving_outputs(SimpleNamespace(checkpoint=SimpleNamespace(dir=str(tmp_path / "local")),
                                            drafter=SimpleNamespace(block_size=BLOCK)), target, export, tau=2.0,
                            log=lambda _: None)
    assert summary["serving_estimate"] is not None
    assert summary["serving_estimate"]["ratio"] == pytest.approx(local["serving_estimate"]["ratio"])
