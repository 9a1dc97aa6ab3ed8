"""Model-only checkpoints: the weights plus the config that builds the model.

They are what `import-hf` writes and what a run can start from (`checkpoint.init_from`).
`load_model_checkpoint` also reads the model out of a full training checkpoint, which is what
`export-hf` needs. Same on-disk format as training checkpoints (DCP + meta.json), just fewer
components.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from trinity_train.checkpoint import dcp_io
from trinity_train.checkpoint.compat import config_from_meta
from trinity_train.checkpoint.integrity import require_sound
from trinity_train.checkpoint.layout import read_meta
from trinity_train.checkpoint.manager import checkpoint_meta, write_checkpoint
from trinity_train.checkpoint.stateful import ModelState
from trinity_train.config import Config, ModelConfig
from trinity_train.errors import CheckpointError
from trinity_train.model import build_model


def save_model_checkpoint(model: nn.Module, cfg: Config, out_dir: str | Path) -> Path:
    """Write `model`'s weights and `cfg` (the full config; its model section builds the model)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointError(f"'{out_dir}' already exists; choose another output directory or delete it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    write_checkpoint({"model": ModelState(model)}, out_dir, checkpoint_meta("model", 0, cfg, ["model"]))
    return out_dir


def model_to_load_into(model_cfg: ModelConfig, device: str | torch.device = "cpu") -> nn.Module:
    """A model whose every value a full state dict will overwrite: allocated without drawing an
    init when all its state is persistent (a large model's init is slow), initialised otherwise."""
    model = build_model(model_cfg, device="meta")
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    if names <= set(model.state_dict()):
        return model.to_empty(device=device)
    return build_model(model_cfg, device=device)


def load_model_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> tuple[nn.Module, Config]:
    """Build the checkpoint's model on `device` and load its weights (model or training checkpoint),
    once `require_sound` has found it whole."""
    path = Path(path)
    require_sound(path)
    meta = read_meta(path)
    cfg = config_from_meta(meta, path)
    if "model" not in meta.get("components", []):
        raise CheckpointError(f"checkpoint '{path}' holds no model weights")
    model = model_to_load_into(cfg.model, device)
    dcp_io.load({"model": ModelState(model)}, path)
    return model, cfg
