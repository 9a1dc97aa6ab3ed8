"""Attention of rows split over the ranks of a context-parallel group (`parallel.cp`, DESIGN §4).

Each of the `cp` ranks of a group holds two of the 2*cp equal chunks of every row, "zigzag":
rank r holds chunks r and 2cp-1-r, concatenated, so that every rank has the same share of the
causal work (`zigzag_index`). Every token keeps its global index in the row: RoPE positions and
document ids are computed on the whole row before the split. Queries stay where they are; keys and
values travel, differently for the two kinds of layer:

- global layers (full causal, NoPE in the trinity block): the keys and values of every rank are
  all-gathered over the group and put back in row order, and each local query attends to the
  whole row with the mask "key index <= query index" (and the same document with
  `model.doc_masking`; the whole row's document ids are on every rank). `GatheredKeys`.
- sliding-window layers: a query needs only the `window - 1` positions before its chunk, which
  live on the rank(s) holding the chunk(s) before it, so only that halo travels, in one
  all-to-all whose splits name exactly those rows (empty pieces for ranks that are not
  neighbours; a window longer than a chunk takes its halo from several ranks). Each chunk's
  queries then attend to [halo + chunk] with the ordinary sliding-window machinery, the halo's
  own query slots zero and dropped. `HaloWindow`.

The model knows no process group: the collectives come from the `ContextExchange` of the
`SequenceShard` the forward is given (`parallel/context_parallel.py` implements it over the cp group; the
backward of each sends the gradients back the way the data came).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from trinity_train.model.attention import (AttentionMask, SlidingWindowBlocks, scaled_dot_product,
                                           sliding_window_attention)


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2*cp) of each row that rank `rank` of a cp group holds, in its order."""
    return rank, 2 * cp - 1 - rank


def zigzag_index(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The global row index of each of rank `rank`'s seq_len / cp tokens: chunks r and 2cp-1-r of
    seq_len / (2cp) tokens, concatenated. LongTensor [seq_len / cp]."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(j * chunk, (j + 1) * chunk, device=device) for j in zigzag_chunks(cp, rank)])


def _owner(position: int, chunk: int, cp: int) -> tuple[int, int]:
    """(rank holding global `position`, its index among that rank's tokens) under the zigzag."""
    j, offset = divmod(position, chunk)
    return (j, offset) if j < cp else (2 * cp - 1 - j, chunk + offset)


class ContextExchange(Protocol):
    """The collectives over one context-parallel group, autograd-aware."""

    cp: int

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, ...] of every rank concatenated along dim 0 in rank order ([cp * N, ...])."""

    def all_to_all(self, x: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        """Rows of x [sum(input_splits), ...] to each rank (input_splits[d] to rank d); returns the
        rows received, by source rank ([sum(output_splits), ...])."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of x over the group."""


@dataclass(frozen=True)
class SequenceShard:
    """This rank's part of the micro-batch's rows under context parallelism: what the model needs
    besides its local input_ids, labels, position ids and document ids."""

    cp: int
    rank: int
    token_index: torch.Tensor  # [T / cp] long: each local token's index in the row
    row_document_ids: torch.Tensor | None  # [B, T]: the whole rows' document ids (model.doc_masking)
    exchange: ContextExchange

    @property
    def seq_len(self) -> int:
        """Tokens of a whole row."""
        return self.token_index.numel() * self.cp


@dataclass(frozen=True)
class HaloPlan:
    """Which rows one rank sends and receives so that each of its two chunks gets the `halo`
    positions before it (fewer near the row's start: the missing ones are left padding)."""

    halo: int  # window - 1
    positions: torch.Tensor  # [2, halo]: the global positions of each local chunk's halo, -1 padding
    send_index: torch.Tensor  # [sum(input_splits)] local token indices, grouped by destination rank
    input_splits: list[int]
    output_splits: list[int]
    # [2 * halo]: for each slot of the two halos, its row among the received ones; the padding
    # slots point one past them (a zero row)
    recv_index: torch.Tensor


def halo_plan(seq_len: int, cp: int, rank: int, window: int, device: torch.device | str = "cpu") -> HaloPlan:
    """The halo exchange of rank `rank` for a sliding window of `window` keys (itself included)
    over rows of `seq_len` tokens split zigzag over `cp` ranks."""
    wanted, send, input_splits, output_splits, recv = _halo_lists(seq_len, cp, rank, window)
    return HaloPlan(window - 1, torch.tensor(wanted, device=device).view(2, window - 1),
                    torch.tensor(send, dtype=torch.long, device=device), list(input_splits), list(output_splits),
                    torch.tensor(recv, dtype=torch.long, device=device))


@functools.lru_cache(maxsize=64)
def _halo_lists(seq_len: int, cp: int, rank: int, window: int) -> tuple[tuple[int, ...], ...]:
    """`halo_plan`'s numbers, as plain tuples (cached: they depend only on the arguments; tensors
    are not cached, so that a planner's fake ones never reach a run)."""
    chunk, halo = seq_len // (2 * cp), window - 1

    def wanted_by(d: int) -> list[int]:
        """Global positions of rank d's two halos, -1 for padding."""
        out = []
        for j in zigzag_chunks(cp, d):
            start = j * chunk
            first = max(0, start - halo)
            out += [-1] * (halo - (start - first)) + list(range(first, start))
        return out

    send, input_splits = [], []
    for d in range(cp):
        mine = [local for p in wanted_by(d) if p >= 0 for owner, local in [_owner(p, chunk, cp)] if owner == rank]
        send += mine
        input_splits.append(len(mine))
    wanted = wanted_by(rank)
    owners = [_owner(p, chunk, cp)[0] if p >= 0 else -1 for p in wanted]
    output_splits = [owners.count(s) for s in range(cp)]
    # A source sends its rows in the order this rank wants them, so they arrive in that order.
    next_row = [sum(output_splits[:s]) for s in range(cp)]
    recv = []
    for owner in owners:
        if owner < 0:
            recv.append(sum(output_splits))  # the zero row after the received ones
        else:
            recv.append(next_row[owner])
            next_row[owner] += 1
    return tuple(wanted), tuple(send), tuple(input_splits), tuple(output_splits), tuple(recv)


def kv_rows(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k, v [B, T, kv, hd] -> [T, B, kv, 2hd]: keys and values travel together, tokens along dim 0
    (the dim collectives split). Public for benchmarks/cp_gather.py, which times the gather alone."""
    return torch.cat([k, v], dim=-1).transpose(0, 1).contiguous()


def _split_kv(rows: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, B, kv, 2hd] -> k, v [B, T, kv, hd]."""
    k, v = rows.transpose(0, 1).split(head_dim, dim=-1)
    return k, v


@dataclass(frozen=True)
class GatheredKeys:
    """A global layer's attention under context parallelism: every key and value of the row,
    gathered; `mask` [B or 1, 1, T / cp, T] True where a local query may attend."""

    exchange: ContextExchange
    row_order: torch.Tensor  # [T]: where global token t lies in the gathered (rank-order) buffer
    mask: torch.Tensor

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, T/cp, heads, hd], k, v [B, T/cp, kv, hd] (this rank's) -> [B, T/cp, heads, hd]."""
        gathered = self.exchange.all_gather(kv_rows(k, v)).index_select(0, self.row_order)
        k_row, v_row = _split_kv(gathered, k.shape[-1])
        return scaled_dot_product(q.transpose(1, 2), k_row.transpose(1, 2), v_row.transpose(1, 2), self.mask,
                                  scale).transpose(1, 2)


def gathered_keys(shard: SequenceShard, batch: int) -> GatheredKeys:
    seq_len, device = shard.seq_len, shard.token_index.device
    gathered_index = torch.cat([zigzag_index(seq_len, shard.cp, r, device) for r in range(shard.cp)])
    row_order = torch.empty_like(gathered_index).scatter_(0, gathered_index, torch.arange(seq_len, device=device))
    query = shard.token_index[:, None]
    mask = (torch.arange(seq_len, device=device)[None, :] <= query)[None, None]  # [1, 1, T/cp, T]
    if shard.row_document_ids is not None:
        docs = shard.row_document_ids
        same_doc = docs.index_select(1, shard.token_index)[:, :, None] == docs[:, None, :]  # [B, T/cp, T]
        mask = mask & same_doc[:, None]
    return GatheredKeys(shard.exchange, row_order, mask)


@dataclass(frozen=True)
class HaloWindow:
    """A sliding-window layer's attention under context parallelism: each of the rank's two chunks
    extended by the halo before it (`plan`), attended as a row of its own with `mask` (the layer's
    usual mask over [2B] rows of halo + chunk positions, the padding before a row's start masked
    by document id -1; the halo's own query slots are zeros, dropped from the output)."""

    exchange: ContextExchange
    plan: HaloPlan
    chunk: int
    mask: AttentionMask

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        b, t, heads, head_dim = q.shape
        plan, c, h = self.plan, self.chunk, self.plan.halo
        rows = kv_rows(k, v)  # [T/cp, B, kv, 2hd]
        received = self.exchange.all_to_all(rows.index_select(0, plan.send_index), plan.output_splits,
                                            plan.input_splits)
        received = F.pad(received, (0, 0, 0, 0, 0, 0, 0, 1))  # the zero row padding points to
        halos = received.index_select(0, plan.recv_index).view(2, h, *rows.shape[1:])
        extended = torch.cat([halos, rows.view(2, c, *rows.shape[1:])], dim=1)  # [2, h + c, B, kv, 2hd]
        # Rows of the extended chunks: [B * 2, h + c, ...], row 2i + j the j-th chunk of row i.
        extended = extended.permute(2, 0, 1, 3, 4).reshape(b * 2, h + c, *rows.shape[2:])
        k_ext, v_ext = extended.split(head_dim, dim=-1)
        q_ext = F.pad(q.reshape(b * 2, c, heads, head_dim), (0, 0, 0, 0, h, 0))
        if isinstance(self.mask, SlidingWindowBlocks):
            out = sliding_window_attention(q_ext, k_ext, v_ext, self.mask, scale)
        else:
            out = scaled_dot_product(q_ext.transpose(1, 2), k_ext.transpose(1, 2), v_ext.transpose(1, 2), self.mask,
                                     scale).transpose(1, 2)
        return out[:, h:].reshape(b, t, heads, head_dim)


def halo_window(shard: SequenceShard, window: int, batch: int,
                layer_mask: Callable[..., AttentionMask]) -> HaloWindow:
    """`layer_mask(seq_len, window, document_ids, batch, device)` builds the layer's mask over the
    extended chunks (the model's `layer_attention_mask`)."""
    device = shard.token_index.device
    plan = halo_plan(shard.seq_len, shard.cp, shard.rank, window, device)
    chunk, h = shard.seq_len // (2 * shard.cp), plan.halo
    # Document ids of each extended chunk: -1 on padding (no real query sees it), the row's own
    # ids elsewhere (all 0 without document masking).
    positions = torch.cat([plan.positions, shard.token_index.view(2, chunk)], dim=1)  # [2, h + c]
    docs = shard.row_document_ids
    if docs is None:
        docs = torch.zeros(batch, shard.seq_len, dtype=torch.long, device=device)
    extended_docs = torch.where(positions >= 0, docs[:, positions.clamp_min(0)], -1)  # [B, 2, h + c]
    mask = layer_mask(h + chunk, window, extended_docs.view(batch * 2, h + chunk), batch * 2, device)
    return HaloWindow(shard.exchange, plan, chunk, mask)


# What a layer's attention receives under context parallelism.
ContextMask = GatheredKeys | HaloWindow


def context_attention_mask(shard: SequenceShard, window: int | None, batch: int,
                           layer_mask: Callable[..., AttentionMask]) -> ContextMask:
    """The mask object of one kind of layer under context parallelism: a halo exchange for a
    window shorter than the row, every key gathered otherwise."""
    if window is not None and window < shard.seq_len:
        return halo_window(shard, window, batch, layer_mask)
    return gathered_keys(shard, batch)
