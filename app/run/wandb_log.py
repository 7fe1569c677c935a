"""wandb logging of the status-line values (`logging.wandb_mode`: offline, online, disabled)."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from app.config.errors import ConfigError
from app.config.schema import Config, LoggingConfig
from app.storage import redact


def _first_line(exc: BaseException) -> str:
    text = redact(str(exc)).strip()
    return text.splitlines()[0] if text else "no message"


class WandbLogger:
    """A no-op when disabled; otherwise one wandb run per driver process, resumed by run name (unique per
    checkpoint.dir, app/run/plan.py run_name). A failing wandb.init is a ConfigError: one line, exit 2."""

    def __init__(self, cfg: LoggingConfig, run_name: str, full: Config) -> None:
        self.run = None
        if cfg.wandb_mode == "disabled":
            return
        import wandb

        from app.storage import local_cache_dir  # wandb writes local files, even for s3:// runs

        config = asdict(full)
        config["checkpoint"]["dir"] = redact(full.checkpoint.dir)  # wandb uploads its config: no URI credentials
        try:
            self.run = wandb.init(project=cfg.wandb_project, name=run_name, id=run_name, resume="allow",
                                  mode=cfg.wandb_mode, config=config, dir=str(local_cache_dir(full.checkpoint.dir)))
        except (wandb.errors.Error, OSError, RuntimeError, TimeoutError, ValueError) as exc:  # no key, no network
            raise ConfigError(f"wandb.init failed for logging.wandb_mode={cfg.wandb_mode} "
                              f"({type(exc).__name__}: {_first_line(exc)}); log in (wandb login, or WANDB_API_KEY), "
                              "or set logging.wandb_mode=offline or disabled") from None

    def log(self, values: dict[str, Any]) -> None:
        if self.run is not None:
            numbers = {k: v for k, v in values.items() if isinstance(v, (int, float))}
            self.run.log(numbers, step=int(values.get("step", 0)))

    def finish(self, summary: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float))})
            self.run.finish()
