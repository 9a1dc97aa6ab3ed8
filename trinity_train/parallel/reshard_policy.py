"""Which FSDP blocks stay gathered from their forward into their backward: the reshard policy
(`parallel.keep_gathered_gib`).

A block resharded after its forward is all-gathered again for its backward: its all-gather bytes
twice a step, for its unsharded weights freed in between. A block kept gathered is gathered once,
and its unsharded weights stay alive from its forward to its backward, on top of everything the
end of the forward holds. The rule, from the last block down:

- the last block is always kept: its backward follows its forward at once (torchtitan's rule);
- the blocks below it are kept while their unsharded bytes (the compute dtype, this rank's TP and
  EP part, its routed experts included) add up to at most `keep_gathered_gib` (the trade DeepSpeed
  ZeRO-3's `stage3_max_live_parameters` makes, counted in bytes): the highest first, since their
  backward comes first and frees them soonest; the first block that does not fit ends the run;
  0 keeps only the last block, inf every block (ZeRO-2's traffic: no all-gather in backward).

`parallel/fsdp.py` applies it; the planner's closed form (plan/formula.py) and benchmarks/
multinode.py's theory price the same choice. The sizes are FSDP's padded gathered buffers
(`gathered_numel`, the planner's count too), the same on every rank: ranks that kept different
blocks would issue different all-gathers and hang.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

GIB = 2**30


def kept_gathered(block_bytes: Sequence[float], budget_gib: float) -> list[bool]:
    """Per block (first to last): whether it stays gathered from its forward into its backward,
    given each block's unsharded bytes on this rank (see the module)."""
    kept = [False] * len(block_bytes)
    spent = 0.0
    for i in reversed(range(len(block_bytes))):
        if i < len(block_bytes) - 1:
            spent += block_bytes[i]
            if spent > budget_gib * GIB:
                break
        kept[i] = True
    return kept


def gathered_numel(shape: Sequence[int], ranks: int, experts: bool = False) -> int:
    """Elements of a parameter of (TP/EP-local) `shape` once FSDP has gathered it over `ranks`:
    dim 0 cut into `ranks` equal chunks, the last padded (torch.chunk), or, for routed experts
    fewer than the ranks, split along dim 1 without padding (`mesh.expert_shard_dim`)."""
    numel = math.prod(shape)
    if ranks == 1 or (experts and ranks > shape[0]):
        return numel
    return -(-shape[0] // ranks) * ranks * (numel // shape[0])
