"""wandb logging of the status values: offline writes a local run, disabled touches nothing."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from app.config.schema import CheckpointConfig, Config, LoggingConfig, ModelConfig
from app.run.wandb_log import WandbLogger


def _cfg(tmp_path: Path, mode: str) -> Config:
    return replace(Config(model=ModelConfig(target="tiny")), checkpoint=CheckpointConfig(dir=str(tmp_path)),
                   logging=LoggingConfig(wandb_mode=mode))


def test_disabled_is_a_no_op(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "disabled")
    logger = WandbLogger(cfg.logging, "r", cfg)
    logger.log({"step": 1, "loss": 2.0})
    logger.finish({"tau_trained": 3.0})
    assert logger.run is None and not any(tmp_path.iterdir())


@pytest.mark.slow
def test_offline_writes_a_local_run_with_the_values(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(tmp_path, "offline")
    logger = WandbLogger(cfg.logging, "offline-run", cfg)
    for step in range(3):
        logger.log({"step": step, "loss": 3.0 - step, "q_hsb": "[1, 2]", "bottleneck": "drafters"})
    logger.finish({"tau_trained": 2.5, "fault_log": []})
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert any(f.suffix == ".wandb" for f in runs[0].iterdir())
