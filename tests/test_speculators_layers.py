"""Which target layers the readers of `drafter-speculators/` tap, against the layers training used (issue 36).

Training's `target_layer_ids` l means the output of decoder layer l (`hidden_states[l + 1]`,
app/model/features.py). The speculators format numbers the same feature l + 1 (from the embeddings).
Where an engine package is importable its own reader runs on the export; otherwise each reader's rule,
as read from its source (READERS below: version, file, function), is applied to the export.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from app.model.drafter import DFlashDrafter
from app.model.export import export_drafter, export_dtype
from app.model.engines import write_speculators
from tests.toy import save_tiny_target, tiny_arch, tiny_qwen3_config

TRAINED = (0, 2)  # of a 4-layer target: training's ids (outputs of decoder layers 0 and 2)


@dataclass(frozen=True)
class Reader:
    """One reader of the speculators config, as read from its source."""
    name: str
    version: str
    source: str  # file: function
    rule: str
    # (speculators config.json, z-lab config.json, the target's layer count) -> the layer outputs it taps
    taps: Callable[[dict, dict, int], list[int]]


def _vllm_taps(spec: dict, zlab: dict, n_layers: int) -> list[int]:
    # update_dflash: dflash_config.target_layer_ids = [i - 1 for i in aux] (z-lab's numbering, hidden_states[t + 1]
    # is layer t's output); eagle_aux_hidden_state_layer_ids = aux, where capture id k is the residual entering
    # layer k, i.e. layer k - 1's output. Both name layer (aux - 1).
    return [i - 1 for i in spec["aux_hidden_state_layer_ids"]]


def _converter_taps(spec: dict, zlab: dict, n_layers: int) -> list[int]:
    # The converter writes aux = [t + 1 for t in target_layer_ids] from a z-lab folder: an export agrees with it
    # when its aux ids are the converter's for the same z-lab config, and then taps what the z-lab config trained.
    expected = [t + 1 for t in zlab["dflash_config"]["target_layer_ids"] if t + 1 != n_layers]
    return list(zlab["dflash_config"]["target_layer_ids"]) if spec["aux_hidden_state_layer_ids"] == expected else \
        [i - 1 for i in spec["aux_hidden_state_layer_ids"]]


READERS = (
    Reader("vLLM speculators reader",
           "vllm-project/vllm main since PR #40727 (merged 2026-04-23; issue 36 saw the same in release 0.33.0)",
           "vllm/transformers_utils/configs/speculators/algos.py: update_dflash",
           "target_layer_ids = aux_hidden_state_layer_ids - 1; eagle_aux_hidden_state_layer_ids = aux", _vllm_taps),
    Reader("speculators DFlash converter",
           "vllm-project/speculators v0.7.0 (1c2895f3) and main c05b95b3 (2026-08-20)",
           "src/speculators/convert/dflash/converter.py: DFlashConverter._build_config",
           "aux_hidden_state_layer_ids = z-lab target_layer_ids + 1 (main also drops id == num_hidden_layers)",
           _converter_taps),
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculators")
    save_tiny_target(root / "target", pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    arch = tiny_arch(tiny_qwen3_config(), num_layers=2, block_size=4, target_layer_ids=TRAINED, mask_token_id=7)
    zlab = export_drafter(DFlashDrafter(arch).eval(), arch, root / "drafter", dtype=export_dtype("bfloat16"))
    spec = write_speculators(zlab, root / "drafter-speculators", root / "target")
    return zlab, spec, root / "target"


def _json(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


@pytest.mark.parametrize("reader", READERS, ids=lambda r: r.name)
def test_each_reader_taps_the_trained_layers(folders, reader):
    zlab, spec, target = folders
    n_layers = _json(target)["num_hidden_layers"]
    assert reader.taps(_json(spec), _json(zlab), n_layers) == list(TRAINED), (reader.version, reader.source)


@pytest.mark.engines
def test_vllm_reader_in_the_loop(folders, engine):
    algos = engine("vllm.transformers_utils.configs.speculators.algos")
    _, spec, _ = folders
    cfg = _json(spec)
    pre = dict(cfg["transformer_layer_config"])
    algos.SUPPORTED_SPECULATORS_TYPES["dflash"](cfg, pre)  # positional: the second name changed across versions
    assert list(pre["dflash_config"]["target_layer_ids"]) == list(TRAINED)
    assert [k - 1 for k in pre["eagle_aux_hidden_state_layer_ids"]] == list(TRAINED)


@pytest.mark.engines
def test_speculators_converter_in_the_loop(folders, engine):
    converter = engine("speculators.convert.dflash.converter")
    zlab, spec, target = folders
    built = converter.DFlashConverter()._build_config(_json(zlab), str(target), None)
    assert list(built.aux_hidden_state_layer_ids) == _json(spec)["aux_hidden_state_layer_ids"]


def test_the_readers_catch_the_training_numbering(folders, tmp_path):
    """The check can fail: an export written in training's numbering (the old one) taps the layer below."""
    zlab, spec, target = folders
    cfg = _json(spec)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "aux_hidden_state_layer_ids": list(TRAINED)}))
    for reader in READERS:
        assert reader.taps(_json(tmp_path), _json(zlab), 4) == [-1, 1], reader.name
