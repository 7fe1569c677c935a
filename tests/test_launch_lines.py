"""Every launch line the project prints starts its engine as written (issue 36).

The printed lines: the run summary's (`print_serving`), report.html's Serving section, and
`python -m app.evaluate --drafter`'s, for a run whose verifier is the local target folder (the default,
`checkpoint.verifier: ""`) and for one naming a hub id. Each is parsed as a shell would and checked against
ENGINES, the flags each engine requires for a DFlash drafter as read from its source, and the speculators
folder served as vLLM's main model against the rule vLLM applies to the verifier it names
(`main_model_missing`); where the engine package is importable its own argument parser parses the line
too, and its own speculators override reads the folder.
"""
from __future__ import annotations

import argparse
import html
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from app.model.drafter import DFlashDrafter
from app.model.export import export_drafter
from app.run.outputs.report_page import render
from app.run.outputs.run_outputs import print_serving, serving_outputs
from tests.toy import save_tiny_target, tiny_arch, tiny_qwen3_config

BLOCK = 4


@dataclass(frozen=True)
class Engine:
    """What one engine refuses to start without, and where that was read."""
    argv0: tuple[str, ...]
    required: tuple[str, ...]  # flags (vLLM: keys of --speculative-config)
    source: str


ENGINES = {
    "vllm": Engine(
        ("vllm", "serve"), ("model", "num_speculative_tokens", "method"),
        "vllm-project/vllm vllm/config/speculative.py SpeculativeConfig.__post_init__ (stored commit 002e77c1): "
        "'A speculative model was provided, but `num_speculative_tokens` was not provided' unless the draft's "
        "hf_config has n_predict (a DFlash folder has none); method is detected as dflash only from 'dflash' in the "
        "draft path, else it stays 'draft_model'"),
    "sglang": Engine(
        ("python", "-m", "sglang.launch_server"),
        ("--model-path", "--speculative-algorithm", "--speculative-draft-model-path"),
        "sgl-project/sglang server-args _handle_dflash: 'DFLASH speculative decoding requires setting "
        "--speculative-draft-model-path'; the block size is read from the draft folder's config"),
}


def engine_of(name: str) -> str:
    return "sglang" if name.startswith("sglang") else "vllm"


def missing(name: str, line: str) -> list[str]:
    """What `line` (engine `name` in `serve`) lacks of its engine's required flags, and wrong values."""
    rule, argv = ENGINES[engine_of(name)], shlex.split(line)
    if tuple(argv[:len(rule.argv0)]) != rule.argv0:
        return [f"starts {argv[:len(rule.argv0)]}, not {list(rule.argv0)}"]
    if engine_of(name) == "sglang":
        bad = [f for f in rule.required if f not in argv]
        if "--speculative-algorithm" in argv and argv[argv.index("--speculative-algorithm") + 1] != "DFLASH":
            bad.append("--speculative-algorithm is not DFLASH")
        return bad
    if "--speculative-config" not in argv:  # the speculators folder as the main model: its config says it all
        return main_model_missing(argv[2]) if len(argv) == 3 else ["--speculative-config"]
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    bad = [k for k in rule.required if k not in spec]
    if spec.get("num_speculative_tokens") not in (None, BLOCK - 1):
        bad.append(f"num_speculative_tokens {spec['num_speculative_tokens']} != block_size - 1")
    if spec.get("method") not in (None, "dflash"):
        bad.append(f"method {spec['method']}")
    return bad


def main_model_missing(folder: str) -> list[str]:
    """vLLM serving a speculators folder as its model (vllm/transformers_utils/config.py
    maybe_override_with_speculators, SpeculatorsConfig.build_vllm_speculative_config): the verifier it names
    is the model, method and token count come from the config."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    spec = cfg.get("speculators_config") or {}
    bad = [] if cfg.get("speculators_model_type") == "dflash" else ["speculators_model_type dflash"]
    if ((spec.get("proposal_methods") or [{}])[0]).get("speculative_tokens") != BLOCK - 1:
        bad.append("proposal_methods[0].speculative_tokens = block_size - 1")
    verifier = (spec.get("verifier") or {}).get("name_or_path")
    if not vllm_takes_verifier(verifier):
        bad.append(f"verifier.name_or_path {verifier!r}: {VERIFIER_RULE}")
    return bad


VERIFIER_RULE = ("vLLM 0.34.0 vllm/transformers_utils/config.py maybe_override_with_speculators (lines 905-918): "
                 "'Speculators verifier must name a remote model repository' unless the name is a str, passes "
                 "huggingface_hub's validate_repo_id and is no existing local path")


def vllm_takes_verifier(verifier) -> bool:
    """vLLM 0.34.0's check of a speculators folder's verifier, as written there (VERIFIER_RULE)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(verifier, str):
        return False
    try:
        validate_repo_id(verifier)
    except HFValidationError:
        return False
    return not (Path(verifier).exists() or Path(verifier).is_symlink())


HUB_ID = "Qwen/Qwen3-8B"  # no such folder here: a hub id to vLLM


@pytest.fixture(scope="module", params=["", HUB_ID], ids=["local-verifier", "hub-verifier"])
def printed(request, tmp_path_factory):
    """engine name -> line, for every place that prints one; "none <where> <engine>" -> the line saying
    why a form is not printed."""
    from app.evaluate import serve_lines

    root = tmp_path_factory.mktemp("lines")
    save_tiny_target(root / "target")
    torch.manual_seed(0)
    arch = tiny_arch(tiny_qwen3_config(), num_layers=1, block_size=BLOCK, target_layer_ids=(0, 2), mask_token_id=7)
    export = export_drafter(DFlashDrafter(arch).eval(), arch, root / "run" / "drafter")
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(dir=str(root / "run"), verifier=request.param),
                          drafter=SimpleNamespace(block_size=BLOCK), model=SimpleNamespace(target=str(root / "target")))
    summary = serving_outputs(cfg, str(root / "target"), str(export), tau=2.0, log=lambda _: None)
    out: dict[str, str] = {}
    log: list[str] = []
    print_serving(summary, log.append)
    for row in log:
        if m := re.match(r"serve with (\w+): (.*)", row):
            out[f"summary {m[1]}"] = m[2]
        if m := re.match(r"no (\w+) line: (.*)", row):
            out[f"none summary {m[1]}"] = m[2]
    section = render([], summary).split('<section id="serving">', 1)[1]
    for engine, line in re.findall(r"<tr><th>(\w+)</th><td><code>(.*?)</code>", section):
        out[f"report {engine}"] = html.unescape(line)
    for engine, why in re.findall(r"<tr><th>(\w+)</th><td>none: (.*?)</td>", section):
        out[f"none report {engine}"] = html.unescape(why)
    for engine, line in serve_lines(cfg, str(root / "target"), str(export)).items():
        out[f"evaluate {engine}"] = line
    return out


def lines_of(printed: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in printed.items() if not k.startswith("none ")}


def test_every_place_prints_every_engine_or_says_why_not(printed):
    """vllm_speculators_main for a hub-id verifier only; for the local default each place says why not."""
    hub = printed["summary vllm"].split()[2] == HUB_ID
    engines = ("vllm", "sglang", "vllm_speculators") + (("vllm_speculators_main",) if hub else ())
    assert set(lines_of(printed)) == {f"{where} {engine}" for where in ("summary", "report") for engine in engines} | {
        "evaluate sglang", "evaluate vllm"}
    # every place serves the one verifier the export names
    assert {shlex.split(line)[2 if engine_of(k.split()[1]) == "vllm" else 4] for k, line in lines_of(printed).items()
            if not k.endswith("vllm_speculators_main")} == {HUB_ID if hub else shlex.split(printed["summary vllm"])[2]}
    nones = {k: v for k, v in printed.items() if k.startswith("none ")}
    assert set(nones) == (set() if hub else {"none summary vllm_speculators_main", "none report vllm_speculators_main"})
    for why in nones.values():
        verifier = shlex.split(printed["summary vllm"])[2]
        assert verifier in why and "remote model repository" in why and "vllm_speculators line" in why, why


def test_each_printed_line_has_its_engines_required_flags(printed):
    bad = {name: missing(name.split()[1], line) for name, line in lines_of(printed).items()}
    assert {k: v for k, v in bad.items() if v} == {}, {engine_of(k.split()[1]): ENGINES[engine_of(k.split()[1])].source
                                                       for k, v in bad.items() if v}


def test_the_verifier_rule_is_vllms(tmp_path, monkeypatch):
    """What vLLM 0.34.0 accepts as a speculators folder's verifier: a hub id, not a path that exists here."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "target").mkdir(parents=True)
    assert vllm_takes_verifier(HUB_ID) and vllm_takes_verifier("target")
    for local in (str(tmp_path / "models" / "target"), "models/target", "./models/target", "~/m", "", None):
        assert not vllm_takes_verifier(local), local


def test_the_check_fails_on_a_main_line_for_a_local_verifier(tmp_path):
    """The line a run printed before for the default verifier (the target folder, absolute): vLLM stops."""
    from app.model.engines import speculators_config

    folder = tmp_path / "drafter-speculators"
    folder.mkdir()
    hf = {"block_size": BLOCK, "vocab_size": 8, "hidden_size": 4, "num_target_layers": 3,
          "dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": 7}}
    (folder / "config.json").write_text(json.dumps(speculators_config(hf, str(tmp_path / "target"))))
    assert missing("vllm_speculators_main", f"vllm serve {folder}") == [
        f"verifier.name_or_path {str(tmp_path / 'target')!r}: {VERIFIER_RULE}"]


def test_the_check_fails_on_a_line_without_the_token_count():
    line = "vllm serve /m --speculative-config '{\"model\": \"/r/drafter-speculators\"}'"
    assert missing("vllm_speculators", line) == ["num_speculative_tokens", "method"]
    assert missing("sglang", "python -m sglang.launch_server --model-path /m") == [
        "--speculative-algorithm", "--speculative-draft-model-path"]


@pytest.mark.engines
def test_vllm_parser_accepts_each_vllm_line(printed, engine):
    arg_utils = engine("vllm.engine.arg_utils")
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser
    parser = arg_utils.EngineArgs.add_cli_args(FlexibleArgumentParser())
    for name, line in lines_of(printed).items():
        if engine_of(name.split()[1]) == "vllm":
            argv = shlex.split(line)
            ns = parser.parse_args(["--model", argv[2], *argv[3:]])
            assert ns.speculative_config is None if len(argv) == 3 else \
                ns.speculative_config["num_speculative_tokens"] == BLOCK - 1, name


@pytest.mark.engines
def test_sglang_parser_accepts_each_sglang_line(printed, engine):
    server_args = engine("sglang.srt.server_args")
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    for name, line in lines_of(printed).items():
        if engine_of(name.split()[1]) == "sglang":
            ns = parser.parse_args(shlex.split(line)[3:])
            assert ns.speculative_algorithm == "DFLASH" and ns.speculative_draft_model_path, name


@pytest.mark.engines
def test_vllms_speculators_override_takes_each_main_line(printed, engine):
    """Where vLLM is installed, its own reader of a speculators folder as the main model (it raises for a
    verifier it refuses)."""
    config = engine("vllm.transformers_utils.config")
    for name, line in lines_of(printed).items():
        argv = shlex.split(line)
        if name.endswith("vllm_speculators_main"):
            model, _, spec = config.maybe_override_with_speculators(model=argv[2], tokenizer=None,
                                                                    trust_remote_code=False)
            assert model == HUB_ID and spec["num_speculative_tokens"] == BLOCK - 1, name
