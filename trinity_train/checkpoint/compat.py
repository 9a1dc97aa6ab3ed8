"""Whether a checkpoint's configuration fits the run that wants to load it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from trinity_train.config import (Config, ModelConfig, config_differences, config_from_dict, describe_differences,
                                  upgrade_stored_config)
from trinity_train.errors import CheckpointError, ConfigError
from trinity_train.model.blocks import global_every, norm_eps

# Model settings that change how a model is trained or computed, not what its weights mean: a
# checkpoint loads under other values of these.
TRAINING_ONLY_MODEL_KEYS = frozenset({
    "expert_impl", "load_balance", "bias_update_rate", "smebu_lambda", "smebu_beta", "smebu_kappa",
    "aux_loss_alpha", "z_loss_weight", "doc_masking", "loss_chunk_tokens", "init_std"})


def config_from_meta(meta: dict, path: Path) -> Config:
    """The resolved config stored in a checkpoint's meta.json (an earlier version's in today's keys)."""
    try:
        return config_from_dict(upgrade_stored_config(meta["config"]))
    except KeyError:
        raise CheckpointError(f"checkpoint '{path}' has no config in its meta.json") from None
    except ConfigError as e:
        raise CheckpointError(f"checkpoint '{path}' was written with a config this version cannot read ({e})") from None


def model_architecture(m: ModelConfig) -> dict[str, Any]:
    """The model settings that decide the weights' shapes and meaning, with defaults resolved
    (`global_every = 0` and `= 4` describe the same trinity model)."""
    arch = dataclasses.asdict(m)
    arch.update(global_every=global_every(m), norm_eps=norm_eps(m))
    return {k: v for k, v in arch.items() if k not in TRAINING_ONLY_MODEL_KEYS}


def check_model_compatible(checkpoint_cfg: Config, cfg: Config, path: Path) -> None:
    """The checkpoint's weights must be those of the model `cfg` builds."""
    diffs = config_differences(model_architecture(checkpoint_cfg.model), model_architecture(cfg.model), "model")
    if diffs:
        raise CheckpointError(
            f"checkpoint '{path}' holds a different model than this run ({describe_differences(diffs)}); "
            "use the checkpoint's model settings or another checkpoint")


def check_same_seq_len(checkpoint_cfg: Config, cfg: Config, path: Path) -> None:
    """A resume continues its checkpoint's data position, which counts sequences of the
    checkpoint's `data.seq_len`: a longer context is a phase of its own (checkpoint/init_from.py)."""
    theirs, ours = checkpoint_cfg.data.seq_len, cfg.data.seq_len
    if theirs != ours:
        raise ConfigError(
            f"data.seq_len: checkpoint '{path}' was trained at data.seq_len={theirs}, this run asks for {ours}, "
            f"and a resume keeps its sequence length; resume with --data.seq_len={theirs}, or start a "
            f"context-extension phase from it in a new run directory with --checkpoint.init_from={path} "
            "(docs/guides/context-extension.md)")
