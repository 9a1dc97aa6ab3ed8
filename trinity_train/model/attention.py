"""Grouped-query attention as in Hugging Face `afmoe`: QK-norm before RoPE, RoPE only where the
layer has a theta (local layers; every layer in the gemma3 variant), sliding-window or full causal
masks, and a sigmoid output gate. NormFormer's per-head scale is optional.

Masks and rotary tables depend only on the batch, not on the layer, so the model builds them once
per forward (`build_attention_mask` or `sliding_window_blocks`, and `rotary_cos_sin`) and hands the
same tensors to every layer of a kind. Under context parallelism the model builds
`context_attention.ContextMask` objects instead, which attend themselves.

A sliding window much shorter than the sequence is computed block by block
(`SlidingWindowBlocks`): each block of window/2 queries attends to the window + window/2 keys that
end with it, so the work grows with T * 1.5 * window instead of T^2 (T^2 / 2 causal), and no T x T
mask is built. (flex_attention would express this too, but on CPUs it has no backward.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trinity_train.kernel_device import kernel_device
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


@dataclass(frozen=True)
class SlidingWindowBlocks:
    """How `sliding_window_attention` cuts a sequence: `num_blocks` blocks of `block` queries (the
    last one padded), each attending to the `window + block` keys that end with the block.
    `mask` [batch * num_blocks, 1, block, window + block] is True where the query may attend."""

    window: int
    block: int
    num_blocks: int
    mask: torch.Tensor


# What a layer's attention receives: a dense boolean mask, blocks of a sliding window, or None for
# plain causal attention.
AttentionMask = torch.Tensor | SlidingWindowBlocks | None


def _key_blocks(x: torch.Tensor, window: int, block: int, num_blocks: int,
                value: float = 0.0) -> torch.Tensor:
    """x [B, T, ...] -> [B, num_blocks, window + block, ...]: for block c the positions
    c*block - window .. c*block + block - 1 (`value` where they fall outside 0 .. T-1).

    Built from window/block + 1 shifted views of the padded sequence, concatenated; (`unfold`
    would do it too, but torch.compile's CPU code for its backward writes out of bounds.)
    """
    shifts = window // block
    pad_end = num_blocks * block - x.shape[1]
    padded = F.pad(x, [0, 0] * (x.dim() - 2) + [window, pad_end], value=value)
    blocks = padded.view(x.shape[0], shifts + num_blocks, block, *x.shape[2:])
    return torch.cat([blocks[:, s:s + num_blocks] for s in range(shifts + 1)], dim=2)


def sliding_window_blocks(seq_len: int, window: int, document_ids: torch.Tensor | None,
                          batch: int, device: torch.device) -> SlidingWindowBlocks:
    """The block mask of a sliding window of `window` keys (itself included) over `seq_len`.

    Query i of block c is position c*b + i; key j of its window + b keys is position
    c*b - window + j, so it may attend when i < j <= i + window (causal, inside the window) and the
    key position is not negative. Padded query positions past `seq_len` see only themselves and
    other padding, and are dropped.
    """
    # Half-window blocks: 1.5 * window keys per query instead of 2 * window with whole windows.
    block = window // 2 if window % 2 == 0 else window
    num_blocks = -(-seq_len // block)
    i = torch.arange(block, device=device)[:, None]
    j = torch.arange(window + block, device=device)[None, :]
    c = torch.arange(num_blocks, device=device)[:, None, None]
    mask = (j > i) & (j <= i + window) & (j >= window - c * block)  # [num_blocks, b, window + b]
    mask = mask.expand(batch, *mask.shape)
    if document_ids is not None:
        # Padding gets a document id of its own, so real queries never see it.
        query_docs = F.pad(document_ids, (0, num_blocks * block - seq_len), value=-1)
        key_docs = _key_blocks(document_ids, window, block, num_blocks, value=-1)
        mask = mask & (query_docs.view(batch, num_blocks, block, 1) == key_docs[:, :, None, :])
    return SlidingWindowBlocks(window, block, num_blocks,
                               mask.reshape(batch * num_blocks, 1, block, window + block))


def scaled_dot_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """SDPA of q [N, heads, Tq, hd] over k, v [N, kv_heads, Tk, hd] (grouped-query), causal when
    `mask` is None."""
    device = kernel_device(q)
    if device == "cpu" and q.dtype == torch.bfloat16:
        # The fused CPU kernel takes about twice as long in bf16 as in fp32, forward + backward
        # (benchmarks/README.md), so bf16 runs attend in fp32 on CPUs (under autocast, which
        # would cast the inputs straight back).
        with torch.autocast("cpu", enabled=False):
            out = scaled_dot_product(q.float(), k.float(), v.float(), mask, scale)
        return out.to(q.dtype)
    groups = q.shape[1] // k.shape[1]
    if mask is None:
        # Causal without a mask tensor: the fused kernels handle GQA themselves.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=groups > 1)
    if groups > 1 and device != "cpu":
        # On GPUs only the memory-efficient/math kernels take a mask, and the efficient one does
        # not take enable_gqa, so the kv heads are expanded instead (the CPU kernel takes both).
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        groups = 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=groups > 1)


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             blocks: SlidingWindowBlocks, scale: float) -> torch.Tensor:
    """Attention of q [B, T, heads, hd] over k, v [B, T, kv_heads, hd] within a sliding window,
    one block of queries at a time; returns [B, T, heads, hd]."""
    b, t, heads, head_dim = q.shape
    w, n, size = blocks.window, blocks.num_blocks, blocks.block
    # Blocks go into the batch dimension: [B*n, heads, b, hd] queries, [B*n, kv, w + b, hd] keys.
    qb = F.pad(q, (0, 0, 0, 0, 0, n * size - t)).view(b * n, size, heads, head_dim).transpose(1, 2)
    # Contiguous, because the fused CPU kernel needs unit stride along head_dim (else: math path).
    kb, vb = (_key_blocks(x, w, size, n).transpose(2, 3).contiguous().flatten(0, 1)
              for x in (k, v))
    out = scaled_dot_product(qb, kb, vb, blocks.mask, scale)
    return out.transpose(1, 2).reshape(b, n * size, heads, head_dim)[:, :t]


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
    """Rotate x [B, T, heads, head_dim] by the tables [B, T, head_dim], in x's dtype (bf16 under
    autocast, as in `transformers`, so that SDPA gets q, k and v of one dtype)."""
    cos, sin = cos.to(x.dtype)[:, :, None], sin.to(x.dtype)[:, :, None]
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

    def forward(self, x: torch.Tensor, mask: AttentionMask,
                rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """x [B, T, d]; `mask` built once per forward for this kind of layer; `rotary` the (cos, sin) of this layer's
        theta, or None when the layer has no RoPE."""
        b, t, _ = x.shape
        # Sizes come from the projections, so a tensor-parallel shard (fewer local heads) works too.
        q = self.q_norm(self.q_proj(x).view(b, t, -1, self.head_dim))  # [B, T, heads, hd]
        k = self.k_norm(self.k_proj(x).view(b, t, -1, self.head_dim))
        v = self.v_proj(x).view(b, t, -1, self.head_dim)
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        scale = self.head_dim ** -0.5
        if isinstance(mask, SlidingWindowBlocks):
            out = sliding_window_attention(q, k, v, mask, scale)
        elif mask is None or isinstance(mask, torch.Tensor):
            out = scaled_dot_product(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
                                     scale).transpose(1, 2)  # [B, T, heads, hd]
        else:  # context parallelism's mask (model/context_attention.py), which fetches the keys it needs
            out = mask.attend(q, k, v, scale)
        if self.head_scale is not None:
            out = out * self.head_scale.to(out.dtype)[:, None]
        out = out.reshape(b, t, -1) * torch.sigmoid(self.gate_proj(x))
        return self.o_proj(out)
