"""Expert-load statistics from one optimizer step's tokens-per-expert counts.

For each MoE layer, with n_i the tokens routed to expert i and mean(n) the balanced load:
max_load = max(n)/mean(n) (1 is perfect balance, E means one expert took everything),
min_load = min(n)/mean(n) (0 means some expert was idle), cv = std(n)/mean(n).
"""

from __future__ import annotations

import torch


def expert_load_stats(counts: torch.Tensor) -> dict[str, list[float] | float]:
    """Per-layer lists and whole-model summaries from counts [num_moe_layers, num_experts]."""
    if counts.numel() == 0:
        return {}
    counts = counts.detach().double().cpu()
    mean = counts.mean(dim=1).clamp_min(1e-12)
    max_load = (counts.max(dim=1).values / mean).tolist()
    min_load = (counts.min(dim=1).values / mean).tolist()
    cv = (counts.std(dim=1, unbiased=False) / mean).tolist()
    return {
        "moe_max_load": max(max_load),  # the worst layer
        "moe_min_load": min(min_load),
        "moe_cv": sum(cv) / len(cv),  # mean over layers
        "moe_max_load_per_layer": max_load,
        "moe_min_load_per_layer": min_load,
        "moe_cv_per_layer": cv,
    }
