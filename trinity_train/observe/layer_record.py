"""The `layers` record of metrics.jsonl (docs/CONTRACT.md, "Run directory"): its field names
and how its lists are indexed. Written by `observe/layer_stats.py`; read by the sinks (which name
each value by its layer) and by anything that draws depth profiles."""

from __future__ import annotations

# Lists of length num_layers, indexed by layer; null where a layer has no such value.
PER_LAYER_FIELDS = ("grad_norm_attn", "grad_norm_ffn", "residual_rms", "attn_out_rms", "attn_post_rms",
                    "ffn_out_rms", "ffn_post_rms", "act_max_over_median", "act_kurtosis")
# `norm_gain` holds one list per norm of a block (null where the block has no such norm) and
# `final_norm`, a number.
NORM_GAIN_FIELDS = ("attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm", "q_norm", "k_norm")
FINAL_NORM = "final_norm"
# Lists indexed by MoE layer: position j is layer `moe_layers[j]`. tokens_per_expert is [M][E].
MOE_LAYERS = "moe_layers"
MOE_FIELDS = ("tokens_per_expert", "expert_bias_spread", "router_entropy", "experts_without_tokens")


def layer_indices(record: dict, key: str, length: int) -> list[int]:
    """The layer each position of the list `record[key]` belongs to."""
    if key in MOE_FIELDS and isinstance(record.get(MOE_LAYERS), list):
        return record[MOE_LAYERS]
    return list(range(length))
