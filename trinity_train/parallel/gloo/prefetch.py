"""FSDP all-gathers issued ahead of their use on gloo's threads: a CPU job's stand-in for the CUDA
stream on which FSDP2 prefetches a GPU job's all-gathers.

- `prefetch_neighbouring_blocks`: each block's all-gather is issued asynchronously while the block
  before it computes (in backward, the block after it: FSDP2's explicit prefetch); FSDP waits for
  it in the block's pre-forward (pre-backward). The same all-gathers, earlier.
- `NextForwardPrefetch`: the next forward's first all-gather (the root unit's, final norm and head;
  and the embedding's where it gathers the whole table, under TP), which nothing computes beside,
  is issued in the optimizer step as soon as those parameters are final (once Muon's AdamW part is
  done and its exchange's pieces have left; after another optimizer's step): it travels while
  Muon's Newton-Schulz runs. Only those units: a block's matrices are Muon's, final only at its
  end. The next forward (or a validation pass) waits for it in FSDP's pre-forward; a checkpoint
  load first discards it. Holds those units unsharded through Muon's part.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule


def units_of(block: nn.Module) -> list[FSDPModule]:
    """A block's FSDP units: the block, and its routed experts when they are their own (EP)."""
    return [m for m in (block, getattr(getattr(block, "mlp", None), "experts", None)) if isinstance(m, FSDPModule)]


def prefetch_neighbouring_blocks(model: nn.Module, held: set[int] = frozenset()) -> None:
    """Issue each block's all-gather while the block before it computes (in backward: the block
    after it). The blocks in `held` prefetch the block below them in backward through
    `ep_backward_hold` (after their expert exchange), not FSDP."""
    blocks = list(model.layers)
    model._set_unshard_async_op(True)  # every unit's own unshard asynchronous too, waited at use
    model.embed.set_modules_to_forward_prefetch(units_of(blocks[0]))
    model.set_modules_to_backward_prefetch(units_of(blocks[-1]))  # the root's backward (head, norm) comes first
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch(units_of(blocks[i + 1]))
        if i > 0 and i not in held:
            block.set_modules_to_backward_prefetch(units_of(blocks[i - 1]))


class NextForwardPrefetch:
    """The next forward's first all-gathers of `units`, issued early (see the module)."""

    def __init__(self, units: list[FSDPModule]):
        self.units = units
        self._handles: list = []

    def issue(self) -> None:
        """Issue them now, on gloo's threads: call once their parameters are final for the step."""
        self._handles = [unit.unshard(async_op=True) for unit in self.units]

    def discard(self) -> None:
        """Before parameters change other than by the optimizer (a checkpoint load): wait for the
        issued all-gathers and free what they gathered, so the next forward gathers the new
        values. A no-op when none is pending."""
        for handle in self._handles:
            handle.wait()  # a no-op for one a forward already waited for
        if self._handles:
            for unit in self.units:
                unit.reshard()
        self._handles = []
