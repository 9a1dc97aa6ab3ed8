"""The reshard policy (`parallel/reshard_policy.py`): which FSDP blocks stay gathered from their
forward into their backward.

- The rule: the last block always; below it, from the top, while the blocks' bytes fit the budget,
  stopping at the first that does not; every block with `keep_gathered_gib = inf`.
- Applied by `apply_fsdp` on two gloo ranks (the tiny model): with the default budget every block
  is gathered once a step, with none only the last; the losses and gradients are the same bits
  (resharding changes when weights are gathered, not what they are).
"""

from __future__ import annotations

import pytest
import torch

from tiny_fsdp import tiny_fsdp_model
from trinity_train.parallel.reshard_policy import GIB, kept_gathered
from trinity_train.plan.collectives import FSDP_ALL_GATHER, CollectiveLog


@pytest.mark.parametrize("sizes, budget, kept", [
    ([1.0, 1.0, 1.0, 1.0], 0.0, [False, False, False, True]),  # only the last
    ([1.0, 1.0, 1.0, 1.0], 2.0, [False, True, True, True]),  # two below it fit
    ([1.0, 3.0, 1.0, 9.0], 2.0, [False, False, True, True]),  # the last is free; block 1 ends the run
    ([5.0, 5.0], float("inf"), [True, True]),  # inf: every block
    ([], 1.0, []),
])
def test_the_last_blocks_stay_gathered_while_they_fit(sizes, budget, kept):
    assert kept_gathered([s * GIB for s in sizes], budget) == kept


def _gathers_by_budget() -> dict:
    out = {}
    for budget in (1.0, 0.0):
        torch.manual_seed(0)
        model, ids = tiny_fsdp_model(keep_gathered_gib=budget)
        log = CollectiveLog()
        with log:
            loss = model(ids, labels=ids).ce_sum
            loss.backward()
        out[budget] = {"loss": loss.detach(), "gathers": sum(c.category == FSDP_ALL_GATHER for c in log.calls),
                       "blocks": len(model.layers),
                       "grads": {n: p.grad.to_local().clone() for n, p in model.named_parameters()}}
    return out


def test_apply_fsdp_gathers_kept_blocks_once_with_the_same_bits(rank_pool):
    for rank, out in enumerate(rank_pool(2).run(_gathers_by_budget)):
        kept_all, resharded = out[1.0], out[0.0]
        # every block but the last gathered again for its backward when none is kept
        assert resharded["gathers"] - kept_all["gathers"] == kept_all["blocks"] - 1, (rank, out)
        assert torch.equal(kept_all["loss"], resharded["loss"]), rank
        for name, grad in resharded["grads"].items():
            assert torch.equal(kept_all["grads"][name], grad), (rank, name)
