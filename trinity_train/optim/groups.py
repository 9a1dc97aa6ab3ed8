"""Which parameter goes to which optimizer, and which parameters get weight decay.

Weight decay applies to hidden matrices (attention, dense and expert FFNs, router, the output
head). It does not apply to the embedding (decaying rows of rare tokens towards zero only hurts
them), nor to norm gains, biases, per-head scales or any other vector: these set scales, and
pulling them to zero fights the normalisation they belong to.

With `optim.name = "muon"`, the hidden matrices (attention q/k/v/gate/o, dense and shared-expert
SwiGLU, routed experts and, if `optim.muon_router`, the router gate) go to Muon at `optim.muon_lr`;
everything else (embedding, head, norm gains, head scales, vectors) stays with AdamW at `optim.lr`,
under the weight-decay rule above. Both kinds live in one optimizer, so one schedule scales both.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from trinity_train.config import OptimConfig
from trinity_train.errors import ConfigError
from trinity_train.optim.muon import Muon

# Muon's hidden matrices by their CONTRACT.md names; wrappers (activation checkpointing, compile)
# may add segments in front, so only the end of the name is matched.
_MUON_MATRIX = re.compile(r"(^|\.)(attn\.(q|k|v|gate|o)_proj\.weight"
                          r"|mlp\.(shared_expert\.)?(gate|up|down)_proj\.weight"
                          r"|mlp\.experts\.(gate|up|down)_proj)$")
_ROUTER_GATE = re.compile(r"(^|\.)mlp\.router\.gate\.weight$")


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


def is_muon_param(name: str, muon_router: bool) -> bool:
    """Whether the parameter called `name` is a hidden matrix that Muon orthogonalises."""
    return bool(_MUON_MATRIX.search(name) or (muon_router and _ROUTER_GATE.search(name)))


def build_optimizer(model: nn.Module, optim_cfg: OptimConfig) -> torch.optim.Optimizer:
    """One optimizer over every trainable parameter; its groups are tagged with `kind`."""
    if optim_cfg.name == "muon":
        return _build_muon(model, optim_cfg)
    if optim_cfg.name != "adamw":
        raise ConfigError(f"optim.name: {optim_cfg.name!r} is not available; use 'adamw' or 'muon'")
    decayed, not_decayed = split_by_weight_decay(model)
    return torch.optim.AdamW(
        adamw_param_groups(decayed, not_decayed, optim_cfg),
        lr=optim_cfg.lr,
        betas=(optim_cfg.beta1, optim_cfg.beta2),
        eps=optim_cfg.eps,
        fused=_can_fuse(decayed + not_decayed) or None,
    )


def _can_fuse(params: list[nn.Parameter]) -> bool:
    """The fused AdamW kernel (one kernel for all parameters, CPU and CUDA) is far faster than
    the per-tensor loop; it needs floating-point parameters on a device it supports."""
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def _build_muon(model: nn.Module, optim_cfg: OptimConfig) -> Muon:
    matrices = [p for name, p in model.named_parameters()
                if p.requires_grad and is_muon_param(name, optim_cfg.muon_router)]
    muon_ids = {id(p) for p in matrices}
    decayed, not_decayed = split_by_weight_decay(model)
    decayed = [p for p in decayed if id(p) not in muon_ids]
    not_decayed = [p for p in not_decayed if id(p) not in muon_ids]
    adamw_groups = adamw_param_groups(decayed, not_decayed, optim_cfg)
    muon_group = {"params": matrices, "kind": "muon", "name": "muon", "lr": optim_cfg.muon_lr,
                  "weight_decay": optim_cfg.weight_decay}
    return Muon(
        ([muon_group] if matrices else []) + adamw_groups,
        lr=optim_cfg.lr,  # the AdamW groups' peak; the Muon group carries its own
        betas=(optim_cfg.beta1, optim_cfg.beta2),
        eps=optim_cfg.eps,
        momentum=optim_cfg.muon_momentum,
        nesterov=optim_cfg.muon_nesterov,
        ns_steps=optim_cfg.muon_ns_steps,
        scale=optim_cfg.muon_scale,
        ns_dtype=optim_cfg.muon_ns_dtype,
        fused=_can_fuse(decayed + not_decayed) or None,  # for the AdamW groups
    )
