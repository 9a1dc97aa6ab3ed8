"""The root unit's gradient reduce-scatter started near the backward's start, not at its end.

The root unit (final norm and head) has no module whose backward ends after everything else's;
FSDP2 registers its post-backward on the root's forward inputs, the token ids, which take no
gradient, so it runs in the backward's final callback and its reduce-scatter (the head's, as large
as the embedding's) travels while nothing computes. The head's gradient is accumulated when the
backward starts (the fused loss computed it in the forward) and the final norm's right after; once
every root parameter's gradient is accumulated (a post-accumulate-grad hook on each gathered
parameter), `reduce_root_at_its_last_gradient` runs FSDP's own post-backward of the root's
parameter group (its reshard and its `foreach_reduce`), which then leaves the reduce-scatter
travelling while the blocks' backward computes; the final callback skips a group already past it.
Only in a backward whose reduce-scatters overlap (`AllToAllReduceScatter.overlapping`): the same
sums, earlier. A GPU job's NCCL stream overlaps it anyway.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

from trinity_train.parallel.gloo.reduce_scatter import AllToAllReduceScatter


def reduce_root_at_its_last_gradient(model: FSDPModule, reduce_scatter: AllToAllReduceScatter) -> None:
    """Install the early reduce-scatter of `model`'s root unit (see the module)."""
    group = model._get_fsdp_state()._fsdp_param_group
    hooked: set[int] = set()
    accumulated: set[int] = set()

    def on_accumulated(param: torch.Tensor) -> None:
        accumulated.add(id(param))
        if (reduce_scatter.overlapping and len(accumulated) == len(hooked)
                and group._training_state != TrainingState.POST_BACKWARD):
            group.post_backward()

    def before_forward(module, args) -> None:
        accumulated.clear()
        for fsdp_param in group.fsdp_params:  # gathered by FSDP's own pre-forward, registered first
            param = fsdp_param.unsharded_param
            if param.requires_grad and id(param) not in hooked:
                param.register_post_accumulate_grad_hook(on_accumulated)
                hooked.add(id(param))

    model.register_forward_pre_hook(before_forward)
