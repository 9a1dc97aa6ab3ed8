"""Expert parallelism (all-to-all dispatch/combine, expert width over tp) against one process.

One 4-rank gloo group checks several layouts of the model's own `GroupedExperts`: every rank's
outputs, input gradients and the summed expert-weight gradients must equal what the unsplit
module computes for the same tokens. Token counts are uneven and some experts get no tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from ranks import init_gloo
from trinity_train.model.moe import GroupedExperts
from trinity_train.parallel.expert_parallel import ExpertParallel, dispatch_tokens, combine_tokens

E, D, I = 8, 16, 16
LAYOUTS = {  # name: (efsdp, ep, tp) over 4 ranks
    "ep2": (2, 2, 1),
    "ep4": (1, 4, 1),
    "tp2": (2, 1, 2),
    "ep2_tp2": (1, 2, 2),
}


def _tokens(data_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token copies sorted by expert, as MoE.forward makes them; every data rank differs."""
    g = torch.Generator().manual_seed(100 + data_rank)
    n = 5 + 7 * data_rank
    experts = torch.randint(0, E, (n,), generator=g)
    experts[experts == data_rank % E] = (data_rank + 3) % E  # this rank sends nothing to one expert
    experts = experts.sort().values
    return torch.randn(n, D, generator=g), torch.bincount(experts, minlength=E)


def _full_experts(impl: str) -> GroupedExperts:
    torch.manual_seed(0)
    experts = GroupedExperts(E, D, I, "silu", impl)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return experts


def _check_layout(shape: tuple[int, int, int], impl: str) -> dict:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("efsdp", "ep", "tp"))
    data_rank = mesh["efsdp", "ep"]._flatten().get_local_rank()
    x, counts = _tokens(data_rank)
    proj = torch.randn(x.shape[0], D, generator=torch.Generator().manual_seed(7 + data_rank))

    ref = _full_experts(impl)
    x_ref = x.clone().requires_grad_()
    out_ref = ref(x_ref, counts)
    (out_ref * proj).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    for g in ref_grads.values():  # the experts see the tokens of every rank of the ep group
        dist.all_reduce(g, group=mesh["ep"].get_group())

    par = parallelize_module(_full_experts(impl), mesh["ep", "tp"], ExpertParallel())
    x_par = x.clone().requires_grad_()
    out = par(x_par, counts)
    (out * proj).sum().backward()
    errors = {"out": (out - out_ref).abs().max().item(),
              "x_grad": (x_par.grad - x_ref.grad).abs().max().item()}
    for n, p in par.named_parameters():
        assert isinstance(p, DTensor) and p.shape == ref_grads[n].shape
        errors[n] = (p.grad.full_tensor() - ref_grads[n]).abs().max().item()
    local_experts = par.gate_proj.to_local().shape[0]
    return {"errors": errors, "local_experts": local_experts}


def _dispatch_roundtrip() -> list:
    """dispatch followed by combine must give every row back in place (ep=4, one empty rank)."""
    group = dist.group.WORLD
    rank = dist.get_rank()
    counts = torch.tensor([[2, 0, 1, 3, 0, 0, 4, 1], [0, 0, 0, 0, 0, 0, 0, 0],
                           [1, 1, 1, 1, 1, 1, 1, 1], [0, 5, 0, 0, 2, 0, 0, 0]])[rank]
    x = torch.arange(int(counts.sum()) * 2, dtype=torch.float32).view(-1, 2) + 1000 * rank
    local, local_counts, plan = dispatch_tokens(x, counts, group)
    back = combine_tokens(local, plan, group)
    return [local_counts.tolist(), local.tolist(), (back - x).abs().max().item() if x.numel() else 0.0]


def _all_checks() -> dict:
    """Everything this file checks, in one spawned group (starting ranks is the slow part)."""
    init_gloo()
    results = {(name, impl): _check_layout(shape, impl)
               for name, shape in LAYOUTS.items() for impl in ("grouped", "loop")}
    results["roundtrip"] = _dispatch_roundtrip()
    return results


@pytest.fixture(scope="module")
def rank_results(rank_pool):
    return rank_pool(4).run(_all_checks)


@pytest.mark.parametrize("impl", ["grouped", "loop"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_matches_single_process(rank_results, layout, impl):
    for rank, results in enumerate(rank_results):
        res = results[(layout, impl)]
        for what, err in res["errors"].items():
            assert err < 1e-5, f"rank {rank} {layout}/{impl}: {what} differs by {err}"
        _, ep, _ = LAYOUTS[layout]
        assert res["local_experts"] == E // ep


def test_dispatch_groups_tokens_by_local_expert_and_combine_restores_them(rank_results):
    results = [r["roundtrip"] for r in rank_results]
    # rank 0 owns experts 0 and 1: it receives expert 0's rows (from ranks 0 then 2), then expert 1's
    # (from ranks 2 then 3); rank 1 sends nothing.
    local_counts, local_rows, _ = results[0]
    assert local_counts == [3, 6]
    firsts = [row[0] for row in local_rows]
    assert firsts == [0.0, 2.0, 2000.0, 2002.0, 3000.0, 3002.0, 3004.0, 3006.0, 3008.0]
    for rank, (_, _, roundtrip_err) in enumerate(results):
        assert roundtrip_err == 0.0, f"rank {rank}: combine did not undo dispatch"
