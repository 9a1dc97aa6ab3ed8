"""Grouped-query attention as in Hugging Face `afmoe`: QK-norm before RoPE, RoPE only where the
layer has a theta (local layers; every layer in the gemma3 variant), sliding-window or full causal
masks, and a sigmoid output gate. NormFormer's per-head scale is optional.

Masks and rotary tables depend only on the batch, not on the layer, so the model builds them once
per forward (`build_attention_mask`, `rotary_cos_sin`) and hands the same tensors to every layer of
a kind.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trinity_train.model.norms import RMSNorm


def positions_from_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Position ids that restart at 0 where the document id changes along each row. [B, T]."""
    idx = torch.arange(document_ids.shape[-1], device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start_of_doc = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=-1).values
    return idx - start_of_doc


def build_attention_mask(seq_len: int, window: int | None, document_ids: torch.Tensor | None,
                         device: torch.device) -> torch.Tensor | None:
    """Boolean mask (True = may attend) broadcastable to [B, heads, T, T], or None for plain causal.

    Query q sees key k when k <= q, q - window < k (window keys, itself included) and, with
    `document_ids`, both lie in the same document. None lets SDPA use its fused causal path.
    """
    if window is not None and window >= seq_len:
        window = None  # the window covers the whole sequence: plain causal
    if window is None and document_ids is None:
        return None
    q = torch.arange(seq_len, device=device)[:, None]
    k = torch.arange(seq_len, device=device)[None, :]
    mask = k <= q
    if window is not None:
        mask = mask & (k > q - window)
    mask = mask[None, None]  # [1, 1, T, T]
    if document_ids is not None:
        same_doc = document_ids[:, :, None] == document_ids[:, None, :]  # [B, T, T]
        mask = mask & same_doc[:, None]
    return mask


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [B, T, head_dim] of the rotate-half RoPE, computed in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device,
                                             dtype=torch.float32) / head_dim))
    freqs = position_ids[..., None].float() * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, T, head_dim] by the tables [B, T, head_dim]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 norm_eps: float, norm_unit_offset: bool, rope_theta: float | None,
                 head_scale: bool):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.rope_theta = rope_theta  # None: no positional encoding (NoPE)
        inner = num_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.gate_proj = nn.Linear(hidden_size, inner, bias=False)
        self.o_proj = nn.Linear(inner, hidden_size, bias=False)
        # One gain of size head_dim, shared by all heads.
        self.q_norm = RMSNorm(head_dim, norm_eps, unit_offset=norm_unit_offset)
        self.k_norm = RMSNorm(head_dim, norm_eps, unit_offset=norm_unit_offset)
        self.head_scale = nn.Parameter(torch.empty(num_heads)) if head_scale else None

    def reset_parameters(self) -> None:
        if self.head_scale is not None:
            with torch.no_grad():
                self.head_scale.fill_(1.0)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None,
                rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """x [B, T, d]; `mask` from `build_attention_mask`; `rotary` the (cos, sin) of this layer's
        theta, or None when the layer has no RoPE."""
        b, t, _ = x.shape
        # Sizes come from the projections, so a tensor-parallel shard (fewer local heads) works too.
        q = self.q_norm(self.q_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        groups = q.shape[1] // k.shape[1]
        if mask is None:
            # Causal without a mask tensor: SDPA's fused kernels handle GQA themselves.
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim ** -0.5,
                                                 enable_gqa=groups > 1)
        else:
            # With an explicit mask only the memory-efficient/math kernels apply, and on GPUs the
            # efficient one does not take enable_gqa, so the kv heads are expanded instead.
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim ** -0.5)

        out = out.transpose(1, 2)  # [B, T, heads, head_dim]
        if self.head_scale is not None:
            out = out * self.head_scale.to(out.dtype)[:, None]
        out = out.reshape(b, t, -1) * torch.sigmoid(self.gate_proj(x))
        return self.o_proj(out)
