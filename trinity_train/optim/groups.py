"""Which parameter goes to which optimizer, and which parameters get weight decay.

Weight decay applies to hidden matrices (attention, dense and expert FFNs, router, the output
head). It does not apply to the embedding (decaying rows of rare tokens towards zero only hurts
them), nor to norm gains, biases, per-head scales or any other vector: these set scales, and
pulling them to zero fights the normalisation they belong to.
"""

from __future__ import annotations

import torch
from torch import nn

from trinity_train.config import OptimConfig
from trinity_train.errors import ConfigError


def split_by_weight_decay(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(decayed, not decayed) trainable parameters, each in `named_parameters` order."""
    embedding_params = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    decayed, not_decayed = [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or id(param) in embedding_params:
            not_decayed.append(param)
        else:
            decayed.append(param)
    return decayed, not_decayed


def adamw_param_groups(params_decayed: list, params_not_decayed: list, optim_cfg: OptimConfig) -> list[dict]:
    groups = [
        {"params": params_decayed, "weight_decay": optim_cfg.weight_decay, "kind": "adamw", "name": "adamw_decay"},
        {"params": params_not_decayed, "weight_decay": 0.0, "kind": "adamw", "name": "adamw_no_decay"},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, optim_cfg: OptimConfig) -> torch.optim.Optimizer:
    """One optimizer over every trainable parameter; its groups are tagged with `kind`."""
    if optim_cfg.name != "adamw":
        raise ConfigError(f"optim.name: {optim_cfg.name!r} is not available in this version; use 'adamw'")
    decayed, not_decayed = split_by_weight_decay(model)
    return torch.optim.AdamW(
        adamw_param_groups(decayed, not_decayed, optim_cfg),
        lr=optim_cfg.lr,
        betas=(optim_cfg.beta1, optim_cfg.beta2),
        eps=optim_cfg.eps,
    )
