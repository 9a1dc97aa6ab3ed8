"""Parameter counts and training FLOPs per token, from the config alone (nothing is built, so
the 400B Large config is counted in microseconds). Tests check the formulas against a meta-device
build of every block variant.
"""

from __future__ import annotations

from dataclasses import dataclass

from trinity_train.config import ModelConfig, is_global_layer
from trinity_train.model.blocks import block_style


@dataclass(frozen=True)
class ParameterCounts:
    total: int  # every trainable parameter (buffers such as expert_bias excluded)
    active: int  # used by one token: total minus the routed experts it is not sent to
    embedding: int  # the input embedding table (a lookup: no FLOPs)
    routed_experts: int  # all routed-expert weights


def _gated_ffn(d: int, width: int) -> int:
    return 3 * d * width  # gate, up, down


def count_parameters(m: ModelConfig) -> ParameterCounts:
    style = block_style(m)
    d, hd = m.hidden_size, m.head_dim
    attn = d * hd * (2 * m.num_heads + 2 * m.num_kv_heads) + m.num_heads * hd * d  # q,gate,k,v,o
    attn += 2 * hd  # q_norm, k_norm
    norms = 2 * d  # attn_norm, mlp_norm
    if style.post_norms:
        norms += 2 * d
    if style.normformer:
        attn += m.num_heads  # head_scale
        norms += 2 * d  # LayerNorm attn_post_norm (weight and bias)
    mid_norm = 2 if style.normformer else 0  # LayerNorm (weight, bias) per unit of FFN width

    dense_ffn = _gated_ffn(d, m.intermediate_size) + mid_norm * m.intermediate_size
    shared_width = m.moe_intermediate_size * m.num_shared_experts
    shared = _gated_ffn(d, shared_width) + (mid_norm * shared_width if shared_width else 0)
    one_expert = _gated_ffn(d, m.moe_intermediate_size)
    moe_fixed = d * m.num_experts + shared  # router gate + shared expert

    num_moe = m.num_layers - m.num_dense_layers
    routed = num_moe * m.num_experts * one_expert
    embedding = m.vocab_size * d
    total = (embedding + m.vocab_size * d + d  # embedding, lm_head, final norm
             + m.num_layers * (attn + norms)
             + m.num_dense_layers * dense_ffn
             + num_moe * moe_fixed + routed)
    unused = num_moe * (m.num_experts - m.num_experts_per_tok) * one_expert
    return ParameterCounts(total=total, active=total - unused, embedding=embedding,
                           routed_experts=routed)


def attended_keys_per_query(m: ModelConfig, layer: int, seq_len: int) -> float:
    """Mean number of keys a query attends to in `layer` over a causal sequence of `seq_len`:
    (T + 1) / 2 on global layers, the mean of min(t + 1, window) on local ones."""
    if is_global_layer(m, layer) or m.sliding_window >= seq_len:
        return (seq_len + 1) / 2
    w = m.sliding_window
    # Positions 0..w-1 see t+1 keys, the remaining T-w positions see w keys each.
    return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len


def training_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per trained token.

    6 * (active parameters except the embedding lookup): 2 per multiply-add forward, 4 backward.
    Attention scores and the weighted sum of values add 2 * 2 * heads * head_dim FLOPs per attended
    key forward, times 3 for training: 12 * heads * head_dim * keys, summed over layers. Keys are
    those actually attended (causal, and the window on local layers), not the padded T x T square
    some MFU conventions use; document masking, which only removes work, is ignored.
    """
    counts = count_parameters(m)
    matmul = 6 * (counts.active - counts.embedding)
    attention = sum(12 * m.num_heads * m.head_dim * attended_keys_per_query(m, i, seq_len)
                    for i in range(m.num_layers))
    return matmul + attention
