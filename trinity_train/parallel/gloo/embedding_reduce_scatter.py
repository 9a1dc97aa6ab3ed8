"""The embedding's gradient reduce-scatter on gloo, sending only the rows a rank's tokens touched.

A step's embedding gradient is zero in every row whose token no sequence of the rank held: a few
percent of a large vocabulary's rows, about a tenth of the default job's 8,192 (the bytes-per-step
table of benchmarks/multinode.py counts it). FSDP reduce-scatters the whole table all the same,
and it is the backward's last reduce-scatter (the embedding's gradient is final only when the
backward ends), so nothing computes while it travels. `TouchedRowsReduceScatter` is FSDP2's
custom reduce-scatter of the embedding's unit on a CPU job without TP (`communication.py`):

1. rank t's chunk of the input is rows [t*R, (t+1)*R) of the (padded) table; a row is touched
   when any bit of it is set (so a -0.0 travels too);
2. one all-to-all of the touched rows' masks (a bit a row), one of the rows (in
   `reduce_wire_dtype` as the dense one sends them), in ascending row order (`row_exchange`);
3. each rank's chunk is rebuilt in a zeroed buffer and summed as `AllToAllReduceScatter` sums:
   the zeros not received are the +0.0 the dense chunk holds there, so every chunk is rebuilt bit
   for bit and the sum is the dense one's, in the same order (tests/test_gloo_reduce_scatter.py).

The two exchanges serve the embedding's forward all-gather too (`embedding_all_gather.py`).
`trinity-train plan` traces without data (no rows to find): there it sends the whole table, and
the planner counts that, an upper bound, as its own category (`FSDP reduce-scatter, embedding
rows`, plan/collectives.py). NCCL keeps FSDP's dense reduce-scatter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trinity_train.parallel.assumed_routing import assumed_routing
from trinity_train.parallel.gloo.reduce_scatter import AllToAllReduceScatter, sum_in_rank_order
from trinity_train.parallel.gloo.row_exchange import exchange_row_masks, exchange_rows

# Integer dtypes of each float width: a row is "touched" when any bit of it is set (-0.0 too).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class TouchedRowsReduceScatter(AllToAllReduceScatter):
    """See the module. `row_numel`: the elements of one row (the hidden size); a chunk not made
    of whole rows, or a data-free trace, goes dense. Blocking: the embedding's is the backward's
    last reduce-scatter, and the step reads its result next."""

    def __init__(self, row_numel: int, wire_dtype: torch.dtype | None = None):
        super().__init__(wire_dtype)
        self.row_numel = row_numel

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        n = group.size()
        if (op != dist.ReduceOp.SUM or async_op or input_tensor.numel() != n * output_tensor.numel()
                or output_tensor.numel() % self.row_numel or assumed_routing() is not None):
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        sent = input_tensor if self.wire_dtype is None else input_tensor.to(self.wire_dtype)
        rows = sent.view(n, -1, self.row_numel)
        touched = rows.view(_BITS[sent.element_size()]).ne(0).any(dim=2)  # [n, R]: rows of chunk t touched here
        theirs = exchange_row_masks(touched, group)  # [n, R]: rows of my chunk rank t touched
        values = exchange_rows([rows[t][touched[t]] for t in range(n)], theirs.sum(dim=1).tolist(), group)
        chunks = sent.new_zeros(rows.shape)
        for t in range(n):
            chunks[t][theirs[t]] = values[t]
        sum_in_rank_order(chunks.view(n, -1), output_tensor)
