"""Weights & Biases logging under `<run.dir>/wandb/`.

`metrics.wandb_mode = "auto"` logs online only when an API key is configured (WANDB_API_KEY or
a netrc entry for the W&B host) and offline otherwise, so a machine without network or account
never waits on a login prompt or a connection. Offline runs can be uploaded later with
`wandb sync <run.dir>/wandb/offline-run-*`. An online start that fails falls back to offline.
"""

from __future__ import annotations

import netrc
import os
import sys
from pathlib import Path

from trinity_train.config import Config, config_to_dict
from trinity_train.observe.scalars import named_values

_INIT_TIMEOUT_S = 60


def has_wandb_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("//")[-1].split("/")[0]
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def resolve_mode(requested: str) -> str:
    if requested == "auto":
        return "online" if has_wandb_api_key() else "offline"
    return requested


class WandbSink:
    def __init__(self, cfg: Config, run_dir: Path):
        import wandb  # imported lazily: slow, and optional

        self._wandb = wandb
        mode = resolve_mode(cfg.metrics.wandb_mode)
        try:
            self.run = self._init(cfg, run_dir, mode)
        except Exception as e:  # any network/auth failure: keep training, log locally
            if mode != "online":
                raise
            print(f"warning: W&B online start failed ({e}); logging offline instead", file=sys.stderr)
            mode = "offline"
            self.run = self._init(cfg, run_dir, mode)
        self.mode = mode

    def _init(self, cfg: Config, run_dir: Path, mode: str):
        run_dir.mkdir(parents=True, exist_ok=True)
        settings = self._wandb.Settings(silent=True, init_timeout=_INIT_TIMEOUT_S, disable_git=True, save_code=False)
        return self._wandb.init(project=cfg.metrics.wandb_project, name=cfg.run.name, group=cfg.run.name,
                                dir=str(run_dir), config=config_to_dict(cfg), mode=mode, settings=settings)

    def write(self, kind: str, record: dict) -> None:
        scalars, histograms = named_values(record, kind)
        values = {**scalars, **{name: self._wandb.Histogram(v) for name, v in histograms.items()}}
        self.run.log(values, step=record["iter"])

    def close(self) -> None:
        self.run.finish()
