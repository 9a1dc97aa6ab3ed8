"""The decoder block and its norm-placement variants (`model.block`, DESIGN §3 table).

| variant    | norms per block                                                        |
|------------|------------------------------------------------------------------------|
| prenorm    | attn_norm, mlp_norm                                                    |
| sandwich   | + attn_post_norm, mlp_post_norm (post gains start at 1)                |
| trinity    | as sandwich, post gains start at 1/sqrt(L)                             |
| gemma3     | as sandwich, every RMSNorm is (1 + g) with g = 0 at init, eps 1e-6;    |
|            | GeGLU FFN; RoPE on global layers too (theta `global_rope_theta`)       |
| normformer | prenorm + LayerNorm attn_post_norm + attn.head_scale + mlp.mid_norm    |

Everything else (attention, router, experts) is the same in every variant, so runs compare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from trinity_train.config import ModelConfig, one_of
from trinity_train.model.attention import Attention
from trinity_train.model.moe import MoE, MoEAux, FeedForward
from trinity_train.model.norms import LayerNorm, RMSNorm


BLOCK_VARIANTS = ("trinity", "sandwich", "prenorm", "gemma3", "normformer")


def check_block_config(m: ModelConfig) -> None:
    """`model.block` names a variant of the table above (ConfigError otherwise);
    `run_config.validate_rules` runs this at load."""
    one_of(m.block, BLOCK_VARIANTS, "model.block")


# The defaults that depend on the variant (0 in the config selects them).
def global_every(m: ModelConfig) -> int:
    """Every this-many-th layer is global (full causal attention)."""
    return m.global_every if m.global_every > 0 else (6 if m.block == "gemma3" else 4)


def norm_eps(m: ModelConfig) -> float:
    return m.norm_eps if m.norm_eps > 0 else (1e-6 if m.block == "gemma3" else 1e-5)


def is_global_layer(m: ModelConfig, i: int) -> bool:
    return (i + 1) % global_every(m) == 0


@dataclass(frozen=True)
class BlockStyle:
    """What `model.block` changes, resolved from the config."""

    post_norms: bool  # RMSNorm on both sublayer outputs (the sandwich)
    post_gain: float  # initial gain of those post norms
    unit_offset: bool  # every RMSNorm is the (1 + g) form
    activation: str  # gate activation of every FFN
    normformer: bool  # LayerNorm after attention, per-head scales, LayerNorm inside the FFN
    eps: float


def block_style(cfg: ModelConfig) -> BlockStyle:
    v = cfg.block
    return BlockStyle(
        post_norms=v in ("trinity", "sandwich", "gemma3"),
        post_gain=1.0 / math.sqrt(cfg.num_layers) if v == "trinity" else 1.0,
        unit_offset=v == "gemma3",
        activation="gelu_tanh" if v == "gemma3" else "silu",
        normformer=v == "normformer",
        eps=norm_eps(cfg),
    )


def layer_rope_theta(cfg: ModelConfig, i: int) -> float | None:
    """RoPE base of layer i: local layers always; global layers only in the gemma3 block (NoPE
    otherwise)."""
    if not is_global_layer(cfg, i):
        return cfg.rope_theta
    return cfg.global_rope_theta if cfg.block == "gemma3" else None


def make_rms_norm(style: BlockStyle, dim: int, gain: float = 1.0) -> RMSNorm:
    """An RMSNorm of the block's form whose effective gain starts at `gain`."""
    return RMSNorm(dim, style.eps, unit_offset=style.unit_offset, init_gain=gain)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        style = block_style(cfg)
        d = cfg.hidden_size
        self.is_global = is_global_layer(cfg, layer_idx)
        self.rope_theta = layer_rope_theta(cfg, layer_idx)

        self.attn_norm = make_rms_norm(style, d)
        self.attn = Attention(d, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, style.eps,
                              style.unit_offset, self.rope_theta, head_scale=style.normformer)
        if style.post_norms:
            self.attn_post_norm: nn.Module | None = make_rms_norm(style, d, style.post_gain)
        elif style.normformer:
            self.attn_post_norm = LayerNorm(d, style.eps)
        else:
            self.attn_post_norm = None

        self.mlp_norm = make_rms_norm(style, d)
        mid_norm_eps = style.eps if style.normformer else None
        self.is_moe = layer_idx >= cfg.num_dense_layers
        self.mlp = (MoE(cfg, style.activation, mid_norm_eps) if self.is_moe
                    else FeedForward(d, cfg.intermediate_size, style.activation, mid_norm_eps))
        self.mlp_post_norm = make_rms_norm(style, d, style.post_gain) if style.post_norms else None

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None,
                rotary: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, MoEAux | None]:
        a = self.attn(self.attn_norm(x), mask, rotary)
        if self.attn_post_norm is not None:
            a = self.attn_post_norm(a)
        x = x + a

        aux = None
        if self.is_moe:
            m, aux = self.mlp(self.mlp_norm(x))
        else:
            m = self.mlp(self.mlp_norm(x))
        if self.mlp_post_norm is not None:
            m = self.mlp_post_norm(m)
        return x + m, aux
