"""Parameter counts and training FLOPs per token, from the config alone (nothing is built, so
the 400B Large config is counted in microseconds). Tests check the formulas against a meta-device
build of every block variant.
"""

from __future__ import annotations

from dataclasses import dataclass

from trinity_train.config import ModelConfig
from trinity_train.model.blocks import block_style, is_global_layer


@dataclass(frozen=True)
class ParameterCounts:
    total: int  # every trainable parameter (buffers such as expert_bias excluded)
    active: int  # used by one token: total minus the routed experts it is not sent to
    embedding: int  # the input embedding table (a lookup: no FLOPs)
    routed_experts: int  # all routed-expert weights
    vectors: int  # norm gains and biases, head scales: elementwise, no matmul FLOPs


def _gated_ffn(d: int, width: int) -> int:
    return 3 * d * width  # gate, up, down


def count_parameters(m: ModelConfig) -> ParameterCounts:
    style = block_style(m)
    d, hd = m.hidden_size, m.head_dim
    num_moe = m.num_layers - m.num_dense_layers
    shared_width = m.moe_intermediate_size * m.num_shared_experts
    one_expert = _gated_ffn(d, m.moe_intermediate_size)
    routed = num_moe * m.num_experts * one_expert
    embedding = m.vocab_size * d

    matrices = (embedding + m.vocab_size * d  # embedding, lm_head
                + m.num_layers * d * hd * (3 * m.num_heads + 2 * m.num_kv_heads)  # q,gate,o,k,v
                + m.num_dense_layers * _gated_ffn(d, m.intermediate_size)
                + num_moe * (d * m.num_experts + _gated_ffn(d, shared_width))  # router, shared
                + routed)

    per_layer = 2 * hd + 2 * d  # q_norm, k_norm, attn_norm, mlp_norm
    if style.post_norms:
        per_layer += 2 * d
    vectors = m.num_layers * per_layer + d  # + final norm
    if style.normformer:
        # head scales, LayerNorm attn_post_norm, LayerNorm mid norms (dense FFN, shared expert)
        vectors += m.num_layers * (m.num_heads + 2 * d)
        vectors += 2 * (m.num_dense_layers * m.intermediate_size + num_moe * shared_width)

    total = matrices + vectors
    unused = num_moe * (m.num_experts - m.num_experts_per_tok) * one_expert
    return ParameterCounts(total=total, active=total - unused, embedding=embedding,
                           routed_experts=routed, vectors=vectors)


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

    6 * (active matrix parameters except the embedding lookup): 2 FLOPs per multiply-add forward,
    4 backward (input and weight gradients); norm gains and other vectors do no matmul.
    Attention scores and the weighted sum of values add 2 * 2 * heads * head_dim FLOPs per attended
    key forward, times 3 for training: 12 * heads * head_dim * keys, summed over layers. Keys are
    those actually attended (causal, and the window on local layers), not the padded T x T square
    some MFU conventions use; document masking, which only removes work, is ignored.
    """
    counts = count_parameters(m)
    matmul = 6 * (counts.active - counts.embedding - counts.vectors)
    attention = sum(12 * m.num_heads * m.head_dim * attended_keys_per_query(m, i, seq_len)
                    for i in range(m.num_layers))
    return matmul + attention
