"""FSDP's gradient reduce-scatter on gloo, sending only this rank's share.

gloo has no reduce-scatter: torch runs one as a clone, an all-reduce of the whole tensor and a
chunk, so each rank sends 2(n-1)/n of its input instead of (n-1)/n (pytorch#118911; the cluster
bed measured 2.03x the credited bytes). gloo's all-to-all is native, so `AllToAllReduceScatter`
sends chunk r of the input to rank r, receives every rank's copy of its own chunk and sums them
locally (the pattern of Megatron's `reduce_scatter_with_fp32_accumulation`). FSDP2 takes it
through `FSDPModule.set_custom_reduce_scatter` (`communication.py` sets it on every unit of a CPU
job); NCCL keeps its own reduce-scatter.

The local sum adds the chunks in rank order, (g0 + g1) + g2 + ...: on two ranks that is the one
sum gloo's all-reduce computes (a float sum of two terms does not depend on their order), so
the results are bitwise today's (tests/test_gloo_reduce_scatter.py). On more ranks gloo's ring
sums each chunk starting at a different rank, so the last bits may differ, as they already do
between any two summation orders.

`AllToAllReduceScatter(wire_dtype=torch.bfloat16)` (`parallel.reduce_wire_dtype = "bf16"`) sends
the chunks in bf16 (cast here, or by FSDP when its policy's reduce dtype is bf16 already, as under
HSDP) and sums the received bf16 pieces in fp32, in the same rank order: the output is the fp32
sum of the bf16-rounded shards (Megatron's fp32 accumulation), rounded once more only if FSDP
hands it a bf16 output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter


class AllToAllReduceScatter(ReduceScatter):
    """FSDP2's `ReduceScatter` protocol: `allocate` its buffers, then `__call__` reduce-scatters
    `input_tensor` (n equal chunks, chunk r for rank r) into `output_tensor` over `group`.

    One object serves every FSDP unit of a model. While `overlapping` (the step sets it for a
    backward whose reduced gradients nothing reads before it ends: see `communication.py`), a
    call only starts the all-to-all (`async_op=True`, on gloo's threads) and returns; the sum
    lands in `output_tensor` when the call after the next one is made, or at `finish()`, which
    the step calls when the backward is over and before anything reads a gradient. So one unit's
    reduce-scatter travels while the next unit's backward computes, and at most two are in
    flight: one more unit's input and received buffers alive than a blocking call keeps. An
    overlapped call's all-to-all starts through `run_or_hold` (in an EP job's backward, after the
    current block's expert exchange: `ep_backward_hold.py`), or when it is completed."""

    IN_FLIGHT = 1  # unit reduce-scatters left travelling behind the newest

    def __init__(self, wire_dtype: torch.dtype | None = None):
        self.overlapping = False
        self.wire_dtype = wire_dtype  # what the chunks travel as (None: FSDP's reduce dtype)
        # Where an overlapped call's all-to-all is started: at once, or when the backward's expert
        # exchange lets it (`ep_backward_hold.py`, an EP job's `BackwardTraffic.run_or_hold`).
        self.run_or_hold: Callable[[Callable[[], None]], None] = lambda start: start()
        self._pending: list[_Transfer] = []

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        # apply_fsdp asks for a plain sum (divide factor 1, forced sum): anything else is a bug.
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"AllToAllReduceScatter sums only; FSDP asked for {op}")
        if async_op:
            raise ValueError("AllToAllReduceScatter runs synchronously; FSDP asked for async_op=True")
        n = group.size()
        if input_tensor.numel() != n * output_tensor.numel():
            raise ValueError(f"reduce-scatter of {input_tensor.numel()} elements into {n} x "
                             f"{output_tensor.numel()}")
        sent = input_tensor if self.wire_dtype is None else input_tensor.to(self.wire_dtype)
        transfer = _Transfer(sent, output_tensor, group)
        self._pending.append(transfer)
        if self.overlapping:
            self.run_or_hold(transfer.start)
        while len(self._pending) > (self.IN_FLIGHT if self.overlapping else 0):
            self._pending.pop(0).complete()
        return None

    def finish(self) -> None:
        """Complete every reduce-scatter still in flight (their gradients are then final)."""
        while self._pending:
            self._pending.pop(0).complete()


class _Transfer:
    """One reduce-scatter: the all-to-all of `sent` (every rank's copy of this rank's chunk lands
    in `received`), then the local sum into `output`."""

    def __init__(self, sent: torch.Tensor, output: torch.Tensor, group: dist.ProcessGroup):
        self.sent, self.output, self.group = sent, output, group
        self.received = torch.empty_like(sent)
        self.work: dist.Work | None = None

    def start(self) -> None:
        """Issue the all-to-all on gloo's threads (once; a second call does nothing)."""
        if self.work is None:
            self.work = dist.all_to_all_single(self.received, self.sent, group=self.group, async_op=True)

    def complete(self) -> None:
        """Wait for the all-to-all (issuing it first if it has not been) and sum into the output."""
        self.start()
        self.work.wait()
        sum_in_rank_order(self.received.view(self.group.size(), -1), self.output)


def sum_in_rank_order(chunks: torch.Tensor, output: torch.Tensor) -> None:
    """`output` = chunks[0] + chunks[1] + ... (every rank's copy of this rank's chunk), in rank
    order whatever this rank's place in it, in fp32 whatever travelled (a bf16 chunk added to fp32
    is added in fp32), in the output itself when it is fp32."""
    out = output.view(-1)
    total = out if out.dtype == torch.float32 else torch.empty_like(out, dtype=torch.float32)
    total.copy_(chunks[0])
    for chunk in chunks[1:]:
        total.add_(chunk)
    if total is not out:
        out.copy_(total)
