"""From an exported drafter to the serving engines (vLLM, SGLang): launch lines, the speculators format, a speed
estimate.

- `launch_lines`: the vLLM and SGLang commands that serve the target with the run's `drafter/` (and
  `drafter-speculators/`). vLLM needs `"method": "dflash"` (it detects DFlash from the path only when
  "dflash" is in it) and `"num_speculative_tokens"` (it does not read `block_size` for DFlash, nor the
  speculators config's token count for a folder named in --speculative-config): `block_size - 1` drafts
  the whole trained block, more asks for positions the drafter never trained. `vllm serve <speculators
  folder>` alone serves the verifier the folder names (`speculators_config.verifier.name_or_path`) with
  the method and token count from its config, but only when that verifier names a hub repository:
  vLLM 0.34 refuses a local one (`remote_verifier`), so for a local verifier there is no such line, and
  `no_main_line` says why in one line. SGLang infers the block size
  from the folder but serves in the checkpoint's dtype unless told, so the line says `--dtype bfloat16`.
- `speculators_config`: the config.json of the speculators format (`speculators_model_type: dflash`,
  the decoder nested in `transformer_layer_config`, `speculators_config.proposal_methods` with the token
  count), with `aux_hidden_state_layer_ids` = target_layer_ids + 1: the format numbers hidden states from
  the embeddings (hidden_states[l + 1] is the output of layer l), and vLLM's reader taps aux - 1.
- `speed_estimate`: the decode speedup a measured tau buys for a stated verify/draft cost ratio.
"""
from __future__ import annotations

import json
import shlex
import struct
from pathlib import Path
from typing import Any

# Decode at small batch reads every weight once per forward: the cost ratio of a target verify to a
# drafter forward is the ratio of the bytes of weights each reads (same dtype on both sides).
RATIO_BASIS = "weights read per forward (decode is memory-bound at small batch)"
SPECULATORS_DIR = "drafter-speculators"


def num_speculative_tokens(block_size: int) -> int:
    """Draft tokens per verify that use the whole trained block: the block's first slot is the anchor."""
    return int(block_size) - 1


def remote_verifier(name: str) -> bool:
    """Whether `vllm serve <speculators folder>` can load `name` as the folder's verifier. vLLM 0.34's
    maybe_override_with_speculators (vllm/transformers_utils/config.py) raises "Speculators verifier must
    name a remote model repository. Select local verifiers explicitly with --model and --speculative-config."
    unless the name passes huggingface_hub's validate_repo_id and no local path of that name exists (an
    absolute path fails the first, an existing relative folder the second). The existence is judged on
    this machine, where the run writes the folder."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return not (Path(name).exists() or Path(name).is_symlink())


def no_main_line(target: str) -> str:
    """Why a run prints no `vllm_speculators_main` line for verifier `target` (one line)."""
    return (f"vLLM serves {SPECULATORS_DIR}/ as its main model only when the verifier it names is a hub "
            f"repository id, and {target} is not one (vLLM 0.34 refuses it: \"Speculators verifier must name "
            "a remote model repository\"); serve it with the vllm_speculators line, which gives the verifier on "
            "the command line, or set checkpoint.verifier to the target's hub id")


def launch_lines(target: str, drafter_dir: str, block_size: int, speculators_dir: str | None = None) -> dict[str, str]:
    """Shell lines that serve `target` with the drafter at `drafter_dir` (paths quoted for a shell). With
    `speculators_dir`, also the lines that serve that folder: `vllm_speculators` always, and
    `vllm_speculators_main` only for a verifier vLLM accepts there (`remote_verifier`)."""
    spec = {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": num_speculative_tokens(block_size)}
    lines = {
        "vllm": f"vllm serve {shlex.quote(str(target))} --speculative-config {shlex.quote(json.dumps(spec))}",
        "sglang": (f"python -m sglang.launch_server --model-path {shlex.quote(str(target))} "
                   f"--speculative-algorithm DFLASH --speculative-draft-model-path {shlex.quote(str(drafter_dir))} "
                   "--dtype bfloat16"),
    }
    if speculators_dir:
        # Named in --speculative-config, vLLM reads neither the method (detected from "dflash" in the path
        # only) nor the token count from the folder: both go in, as for drafter/.
        spec = {**spec, "model": str(speculators_dir)}
        lines["vllm_speculators"] = (f"vllm serve {shlex.quote(str(target))} --speculative-config "
                                     f"{shlex.quote(json.dumps(spec))}")
        # As the main model, vLLM takes all three from the folder: the verifier it names, method, token count;
        # a local verifier stops it there (remote_verifier), so the line is printed for a hub id only.
        if remote_verifier(str(target)):
            lines["vllm_speculators_main"] = f"vllm serve {shlex.quote(str(speculators_dir))}"
    return lines


def speculators_layer_ids(target_layer_ids) -> list[int]:
    """Training's layer ids (l: the output of decoder layer l, `hidden_states[l + 1]`) in the speculators
    format's numbering, l + 1: what vLLM's speculators reader subtracts 1 from and the speculators
    converter writes for a z-lab folder (tests/test_speculators_layers.py names both sources)."""
    return [int(i) + 1 for i in target_layer_ids]


def speculators_config(hf_config: dict[str, Any], target_name: str = "", target_architectures: list | None = None,
                       ) -> dict[str, Any]:
    """The speculators-format config.json for an export whose z-lab config.json is `hf_config`."""
    dflash = hf_config["dflash_config"]
    aux_ids = speculators_layer_ids(dflash["target_layer_ids"])
    block = int(hf_config["block_size"])
    decoder = {k: v for k, v in hf_config.items()
               if k not in ("architectures", "dflash_config", "block_size", "num_target_layers")
               and not k.startswith("dflash_ray")}
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": "0.9.0",
        "block_size": block,
        "mask_token_id": int(dflash["mask_token_id"]),
        # The format numbers hidden states from the embeddings: layer l's output is l + 1. vLLM's reader
        # (update_dflash) taps aux - 1; the speculators converter writes target_layer_ids + 1.
        "aux_hidden_state_layer_ids": aux_ids,
        "eagle_aux_hidden_state_layer_ids": aux_ids,  # what vLLM's reader derives from aux: the same numbers
        "dflash_config": dict(dflash),
        "draft_vocab_size": int(hf_config["vocab_size"]),  # the full vocabulary: no t2d/d2t maps
        "target_hidden_size": int(hf_config["hidden_size"]),
        "num_target_layers": int(hf_config["num_target_layers"]),
        "dtype": hf_config.get("dtype", "bfloat16"),
        "transformer_layer_config": decoder,
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens(block)}],
            "verifier": {"name_or_path": target_name, "architectures": list(target_architectures or [])},
        },
    }


def write_speculators(export_dir: str | Path, out_dir: str | Path, target_dir: str | Path | None = None,
                      target_name: str | None = None) -> Path:
    """`out_dir` as the speculators format of the z-lab export at `export_dir`: the same weights
    (hard-linked when the filesystem allows, else copied) and the speculators config.json. Its verifier is
    `target_name` (what engines load, e.g. an HF id for a converted GGUF), else `target_dir`; the
    architectures come from `target_dir`'s config.json."""
    import os
    import shutil

    src, out = Path(export_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = json.loads((src / "config.json").read_text())
    arches: list = []
    if target_dir is not None and (Path(target_dir) / "config.json").is_file():
        arches = json.loads((Path(target_dir) / "config.json").read_text()).get("architectures") or []
    weights = out / "model.safetensors"
    weights.unlink(missing_ok=True)
    try:
        os.link(src / "model.safetensors", weights)
    except OSError:
        shutil.copyfile(src / "model.safetensors", weights)
    cfg = speculators_config(hf, str(target_name or target_dir or ""), arches)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")  # last: a reader sees complete weights
    return out


def safetensors_bytes(folder: str | Path) -> int:
    """Bytes of the tensors in a folder's *.safetensors files, read from their headers (no weights loaded)."""
    total = 0
    for path in sorted(Path(folder).glob("*.safetensors")):
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        total += sum(end - begin for k, v in header.items() if k != "__metadata__" for begin, end in [v["data_offsets"]])
    return total


def cost_ratio(target_dir: str | Path, drafter_dir: str | Path, vocab_size: int, hidden_size: int) -> float | None:
    """Verify/draft cost ratio from the weights each forward reads, counted in parameters (both sides
    serve in one dtype): the whole target against the drafter plus the target's LM head it drafts
    through. None when either folder has no safetensors."""
    target, drafter = safetensors_bytes(target_dir), safetensors_bytes(drafter_dir)
    if not target or not drafter:
        return None
    target_params = target / _itemsize(Path(target_dir) / "config.json")
    drafter_params = drafter / _itemsize(Path(drafter_dir) / "config.json") + vocab_size * hidden_size
    return target_params / drafter_params


def _itemsize(config_path: Path) -> int:
    cfg = json.loads(config_path.read_text()) if config_path.is_file() else {}
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return {"float32": 4, "float16": 2, "bfloat16": 2}.get(str(dtype).removeprefix("torch."), 2)


def speed_estimate(tau: float | None, ratio: float | None) -> dict[str, Any] | None:
    """Expected decode speedup over plain decoding: one cycle is a target verify (about one plain decode
    step: memory-bound, the block rides along) plus one drafter forward (1/ratio of a step) and yields
    tau tokens, so speedup = tau / (1 + 1 / ratio)."""
    if tau is None or ratio is None or ratio <= 0:
        return None
    return {
        "formula": "speedup = tau / (1 + 1 / ratio)",
        "tau": float(tau),
        "ratio": float(ratio),
        "ratio_basis": RATIO_BASIS,
        "assumes": "a verify of the block costs one plain decode step; the drafter runs once per block",
        "speedup": float(tau) / (1.0 + 1.0 / float(ratio)),
    }
