"""wandb logging of the status values: offline writes a local run, disabled touches nothing."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from app.config.errors import ConfigError
from app.config.run_sections import CheckpointConfig, LoggingConfig
from app.config.schema import Config, ModelConfig
from app.run.outputs.wandb_log import WandbLogger


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


def test_a_failing_wandb_init_is_one_config_error_line(tmp_path: Path, monkeypatch) -> None:
    """Issue 22 item 18: wandb.init's error (no API key, no network) was a traceback, exit 1; now one
    ConfigError line (the driver exits 2 with it) naming the mode and the fix, with no URI credentials."""
    import wandb

    def refuse(**_kw):
        raise wandb.errors.CommError("Network error (ConnectionError) at s3://key:secret@host/x\nretrying")

    monkeypatch.setattr(wandb, "init", refuse)
    cfg = _cfg(tmp_path, "online")
    with pytest.raises(ConfigError) as err:
        WandbLogger(cfg.logging, "r", cfg)
    assert str(err.value) == ("wandb.init failed for logging.wandb_mode=online (CommError: Network error "
                              "(ConnectionError) at s3://***@host/x); log in (wandb login, or WANDB_API_KEY), or set "
                              "logging.wandb_mode=offline or disabled")


def test_two_runs_whose_folders_share_a_name_get_two_run_names(tmp_path: Path) -> None:
    """Item 18: the run name (wandb id, the metrics' run label) was the folder's basename, so runs/a/exp
    and runs/b/exp merged into one wandb run and one label; now basename plus a digest of the path."""
    from app.run.plan import run_name

    def name(root: str, explicit: str = "") -> str:
        return run_name(replace(Config(model=ModelConfig(target="tiny")), checkpoint=CheckpointConfig(dir=root),
                                logging=LoggingConfig(run_name=explicit)))

    a, b = name(str(tmp_path / "a" / "exp")), name(str(tmp_path / "b" / "exp"))
    assert a != b and a.startswith("exp-") and b.startswith("exp-") and len(a) == len("exp-") + 6
    assert name(str(tmp_path / "a" / "exp") + "/") == a == name(str(tmp_path / "a" / "x" / ".." / "exp"))
    assert name("s3://bucket/runs/exp") != name("s3://other/runs/exp")
    assert name(str(tmp_path / "a" / "exp"), explicit="mine") == "mine"
