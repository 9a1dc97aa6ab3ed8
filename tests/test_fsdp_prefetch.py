"""The next forward's first all-gathers, issued in the optimizer step (`parallel/gloo`,
`GlooCommunication.prefetch_next_forward`), on two gloo ranks with the tiny model under FSDP.

- Prefetched, the forward issues one all-gather fewer (the root unit's: it waits for the
  prefetched one; the embedding's rows are gathered in its own pre-forward, which needs the ids,
  `parallel/gloo/embedding_all_gather.py`) and computes the same loss and gradients bit for bit.
- Parameters changed after the prefetch (what a checkpoint load does) are what the next forward
  uses once `discard_next_forward` has run; without it the forward would use the gathered old
  values (checked too, so the check can fail).
- Muon runs its while-orthogonalising hooks after its AdamW part and before its Muon part when no
  packed exchange runs (one process), where a CPU job prefetches; with a packed exchange they run
  once the pieces have left (tests/test_muon_distributed.py).
"""

from __future__ import annotations

import pytest
import torch

from tiny_fsdp import tiny_fsdp_job
from trinity_train.optim.muon import Muon
from trinity_train.parallel.gloo.communication import GlooOverlap
from trinity_train.plan.collectives import FSDP_ALL_GATHER, CollectiveLog


def _checks() -> dict:
    model, ids, communication = tiny_fsdp_job(GlooOverlap())

    def step() -> dict:
        """A forward and backward: the loss, the gradients, the FSDP all-gathers issued."""
        log = CollectiveLog()
        with log:
            loss = model(ids, labels=ids).ce_sum
            loss.backward()
        grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        gathers = sum(1 for call in log.calls if call.category == FSDP_ALL_GATHER)
        return {"loss": loss.detach(), "grads": grads, "gathers": gathers}

    def scale_shards() -> None:  # new values in the sharded parameters, as a checkpoint load writes
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().mul_(1.5)

    result = {"plain": step()}
    communication.prefetch_next_forward()
    result["prefetched"] = step()

    communication.prefetch_next_forward()
    scale_shards()
    communication.discard_next_forward()
    result["discarded"], result["after discarded"] = step(), step()

    communication.prefetch_next_forward()
    scale_shards()
    result["stale"], result["after stale"] = step(), step()
    return result


def _muon_steps() -> dict:
    """Three Muon steps of the tiny model under FSDP, the next forward's all-gathers issued in the
    optimizer step where a CPU job's install issues them (Muon's while-orthogonalising hook), and
    without: the losses."""
    from trinity_train.config import OptimConfig
    from trinity_train.optim.groups import build_optimizer

    losses, gathers_in_step = {}, {}
    for prefetch in (False, True):
        torch.manual_seed(0)
        model, ids, communication = tiny_fsdp_job(GlooOverlap(all_gather=prefetch))
        opt = build_optimizer(model, OptimConfig(name="muon"))
        opt.register_while_orthogonalising_hook(communication.prefetch_next_forward)  # a no-op unprefetched
        losses[prefetch], gathers_in_step[prefetch] = [], 0
        for _ in range(3):
            loss = model(ids, labels=ids).ce_sum
            loss.backward()
            with CollectiveLog() as log:
                opt.step()
            gathers_in_step[prefetch] += sum(call.category == FSDP_ALL_GATHER for call in log.calls)
            opt.zero_grad(set_to_none=True)
            losses[prefetch].append(loss.detach())
    return {"losses": losses, "gathers_in_step": gathers_in_step}


@pytest.mark.slow  # two-rank Muon runs with and without it (~11 s); the prefetched forward is checked fast below
def test_the_prefetch_in_the_optimizer_step_gathers_only_final_values(rank_pool):
    """What it gathers must be final when it is issued: a block's matrices (Muon's, updated after
    the hook) gathered there would feed the next forward stale weights."""
    for rank, result in enumerate(rank_pool(2).run(_muon_steps)):
        losses = result["losses"]
        assert all(torch.equal(a, b) for a, b in zip(losses[False], losses[True])), f"rank {rank}: {losses}"
        assert not torch.equal(losses[True][0], losses[True][2])  # the steps change the weights
        # the prefetch did gather inside the optimizer step (the root unit's, each step), and only then
        assert result["gathers_in_step"] == {False: 0, True: 3}, f"rank {rank}: {result['gathers_in_step']}"


@pytest.fixture(scope="module")
def prefetch_results(rank_pool) -> list[dict]:
    return rank_pool(2).run(_checks)


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["loss"], b["loss"]) and all(torch.equal(g, b["grads"][n]) for n, g in a["grads"].items())


def test_a_prefetched_forward_waits_for_the_first_gathers_and_gives_the_same_bits(prefetch_results):
    for rank, result in enumerate(prefetch_results):
        plain, prefetched = result["plain"], result["prefetched"]
        assert plain["gathers"] - prefetched["gathers"] == 1, f"rank {rank}: {plain['gathers']}, {prefetched['gathers']}"
        assert _same(plain, prefetched), f"rank {rank}"


def test_a_discarded_prefetch_leaves_the_next_forward_the_new_values(prefetch_results):
    for rank, result in enumerate(prefetch_results):
        assert _same(result["discarded"], result["after discarded"]), f"rank {rank}"
        assert not torch.equal(result["discarded"]["loss"], result["plain"]["loss"])
        # not discarded: the root's old values were used
        assert not torch.equal(result["stale"]["loss"], result["after stale"]["loss"]), f"rank {rank}"


def test_muon_runs_its_hook_between_the_adamw_and_the_muon_parts_in_one_process():
    matrix, vector = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    opt = Muon([{"params": [matrix], "kind": "muon"}, {"params": [vector], "kind": "adamw"}], lr=0.1)
    before = {"matrix": matrix.detach().clone(), "vector": vector.detach().clone()}
    seen = {}
    matrix.grad, vector.grad = torch.randn(4, 4), torch.randn(4)
    handle = opt.register_while_orthogonalising_hook(
        lambda: seen.update(vector=not torch.equal(vector, before["vector"]), matrix=not torch.equal(matrix, before["matrix"])))
    opt.step()
    assert seen == {"vector": True, "matrix": False}
    assert not torch.equal(matrix, before["matrix"])
    handle.remove()
    seen.clear()
    opt.step()
    assert seen == {}  # removed, as torch's optimizer hooks
