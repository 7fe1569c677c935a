"""wandb logging of the status-line values (`logging.wandb_mode`: offline, online, disabled)."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from app.config.schema import Config, LoggingConfig


class WandbLogger:
    """A no-op when disabled; otherwise one wandb run per driver process, resumed by run name."""

    def __init__(self, cfg: LoggingConfig, run_name: str, full: Config) -> None:
        self.run = None
        if cfg.wandb_mode == "disabled":
            return
        import wandb

        from app.storage import local_cache_dir, redact  # wandb writes local files, even for s3:// runs

        config = asdict(full)
        config["checkpoint"]["dir"] = redact(full.checkpoint.dir)  # wandb uploads its config: no URI credentials
        self.run = wandb.init(project=cfg.wandb_project, name=run_name, id=run_name, resume="allow",
                              mode=cfg.wandb_mode, config=config, dir=str(local_cache_dir(full.checkpoint.dir)))

    def log(self, values: dict[str, Any]) -> None:
        if self.run is not None:
            numbers = {k: v for k, v in values.items() if isinstance(v, (int, float))}
            self.run.log(numbers, step=int(values.get("step", 0)))

    def finish(self, summary: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float))})
            self.run.finish()
