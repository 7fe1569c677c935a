"""The verifier drafter-speculators/ names, which `vllm serve <run>/drafter-speculators` loads as its model (issue 36).

vLLM serves the speculators folder's `speculators_config.verifier.name_or_path` as the target
(vllm/transformers_utils/config.py maybe_override_with_speculators): a relative path there only works
from the training run's folder, so the export writes the target folder absolute, or the hub id / path
the user gives in `checkpoint.verifier`, and the summary says which and how to change it. vLLM 0.34 takes
only a hub id there, so the main-model line is printed for a hub-id verifier alone.
"""
from __future__ import annotations

import json
import shlex
from types import SimpleNamespace

import pytest
import torch

from app.config.run_sections import CheckpointConfig
from app.model.drafter import DFlashDrafter
from app.model.export import export_drafter
from app.run.outputs.run_outputs import print_serving, serving_outputs
from tests.toy import save_tiny_target, tiny_arch, tiny_qwen3_config


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A run whose model.target is given relative to the folder it was started in."""
    monkeypatch.chdir(tmp_path)
    save_tiny_target(tmp_path / "models" / "target")
    torch.manual_seed(0)
    arch = tiny_arch(tiny_qwen3_config(), num_layers=1, block_size=4, target_layer_ids=(0, 2), mask_token_id=7)
    export = export_drafter(DFlashDrafter(arch).eval(), arch, tmp_path / "run" / "drafter")
    return tmp_path, str(export)


def _cfg(root, verifier: str = ""):
    return SimpleNamespace(checkpoint=SimpleNamespace(dir=str(root / "run"), verifier=verifier),
                           drafter=SimpleNamespace(block_size=4))


def _named(root) -> str:
    cfg = json.loads((root / "run" / "drafter-speculators" / "config.json").read_text())
    return cfg["speculators_config"]["verifier"]["name_or_path"]


def test_a_relative_target_is_named_absolute(run):
    root, export = run
    summary = serving_outputs(_cfg(root), "models/target", export, tau=None, log=lambda _: None)
    want = str(root / "models" / "target")
    assert _named(root) == want and summary["verifier"] == want and summary["verifier_from"] == "model.target"
    assert shlex.split(summary["serve"]["vllm"])[2] == want
    # vLLM refuses a local verifier in a folder served as the main model: no such line, and the reason
    assert "vllm_speculators_main" not in summary["serve"]
    assert summary["serve_none"]["vllm_speculators_main"].startswith(
        f"vLLM serves drafter-speculators/ as its main model only when the verifier it names is a hub repository id, "
        f"and {want} is not one")
    printed: list[str] = []
    print_serving(summary, printed.append)
    assert [r for r in printed if r.startswith("no ")] == [
        f"no vllm_speculators_main line: {summary['serve_none']['vllm_speculators_main']}"]


def test_the_users_verifier_is_named_and_served(run):
    root, export = run
    summary = serving_outputs(_cfg(root, "Qwen/Qwen3-8B"), "models/target", export, tau=None, log=lambda _: None)
    assert _named(root) == "Qwen/Qwen3-8B" and summary["verifier_from"] == "checkpoint.verifier"
    assert shlex.split(summary["serve"]["vllm"])[2] == "Qwen/Qwen3-8B"
    sglang = shlex.split(summary["serve"]["sglang"])
    assert sglang[sglang.index("--model-path") + 1] == "Qwen/Qwen3-8B"
    assert summary["serve"]["vllm_speculators_main"] == f"vllm serve {root / 'run' / 'drafter-speculators'}"
    assert summary["serve_none"] == {}
    printed: list[str] = []
    print_serving(summary, printed.append)
    assert printed[0] == ("verifier (the target engines load, named in drafter-speculators/config.json): Qwen/Qwen3-8B "
                          "(from checkpoint.verifier); to name another, a hub id or a path on the serving machine, "
                          "set checkpoint.verifier=... or edit speculators_config.verifier.name_or_path there")


@pytest.mark.parametrize("bad", [" Qwen/Qwen3-8B", "s3://key:secret@host/m"])
def test_a_verifier_with_spaces_or_credentials_is_refused(bad):
    with pytest.raises(ValueError, match="checkpoint.verifier="):
        CheckpointConfig(verifier=bad)
