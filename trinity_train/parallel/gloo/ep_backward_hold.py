"""A backward's FSDP traffic held back while the expert exchange of an EP block needs the link.

In the backward of a block with expert parallelism the MoE's gradients travel first (the
combine's and then the dispatch's all-to-all), and nothing computes while they do. FSDP issues its
own traffic just before: the reduce-scatter of the block above (at that block's post-backward),
the all-gather of the block below (prefetched at this block's pre-backward) and, at the start of
the backward, the root unit's reduce-scatter. On a link that sends in order (one TCP queue, the
cluster bed's shaped link) those bytes go first and the expert exchange waits behind them
(benchmarks/multinode.py --where: the EP waits of the backward grew from +0.04 s to +0.08 s a step
at 1 Gbit/s when the root's reduce-scatter moved to the backward's start).

`BackwardTraffic` holds them instead: in a backward, until the lowest EP block's exchange is
done, FSDP's reduce-scatters (`AllToAllReduceScatter` asks `run_or_hold` to start each one) and
the backward prefetch of the block below an EP block are started only when an EP block's
exchange is over (its MoE input's gradient is complete: a tensor hook), and then travel while that
block's attention backward computes, before the next block's expert exchange. After the lowest EP
block everything starts at once, as before. The same collectives with the same inputs, started
later within the backward: the same sums. A CPU job with EP only
(`communication.py`); FSDP2's streams order a GPU job's traffic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup


class BackwardTraffic:
    """Starts of collectives held until an EP block's exchange is over (see the module)."""

    def __init__(self):
        self.holding = False  # from each forward until the lowest EP block's exchange in its backward
        self._held: list[Callable[[], None]] = []

    def run_or_hold(self, start: Callable[[], None]) -> None:
        """`start()` now, or when the expert exchange under way in this backward is over."""
        if self.holding:
            self._held.append(start)
        else:
            start()

    def release(self, last: bool) -> None:
        """An EP block's exchange is over: start what was held; `last`: the lowest EP block's,
        after which nothing is held in this backward."""
        held, self._held = self._held, []
        if last:
            self.holding = False
        for start in held:
            start()

    def reset(self) -> None:
        """A new forward: hold again in its backward (nothing is held between backwards; an
        interrupted backward's held starts are dropped, as FSDP drops its own state)."""
        self._held.clear()
        self.holding = True


def _prefetch_backward(units: list[FSDPModule]) -> Callable[[], None]:
    """FSDP2's own backward prefetch of `units` (what `set_modules_to_backward_prefetch` runs)."""
    def start() -> None:
        for unit in units:
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                FSDPParamGroup._prefetch_unshard(group, "backward")
    return start


def hold_backward_traffic(model: nn.Module, expert_blocks: list[int], traffic: BackwardTraffic,
                          units_of: Callable[[nn.Module], list[FSDPModule]] | None) -> None:
    """Install `traffic` on `model`, whose blocks at `expert_blocks` exchange their tokens over EP:
    reset at each forward, released when each of those blocks' MoE input has its gradient (the
    lowest one last), and, given `units_of` (a block's FSDP units: the job prefetches), each of
    those blocks' backward prefetch of the block below it held (instead of FSDP's, which
    `prefetch_neighbouring_blocks` leaves unset for them)."""
    blocks = list(model.layers)
    lowest = min(expert_blocks)
    model.register_forward_pre_hook(lambda module, args: traffic.reset())

    def on_moe_input(index: int):
        def hook(module, args) -> None:
            x = args[0]
            if torch.is_grad_enabled() and x.requires_grad:
                x.register_hook(lambda grad: traffic.release(last=index == lowest))
        return hook

    def on_block_output(units: list[FSDPModule]):
        start = _prefetch_backward(units)

        def hook(module, args, out) -> None:
            x = out[0] if isinstance(out, tuple) else out
            if torch.is_grad_enabled() and x.requires_grad:
                x.register_hook(lambda grad: traffic.run_or_hold(start))
        return hook

    for i in expert_blocks:
        blocks[i].mlp.register_forward_pre_hook(on_moe_input(i))
        if i > 0 and units_of is not None:
            blocks[i].register_forward_hook(on_block_output(units_of(blocks[i - 1])))
