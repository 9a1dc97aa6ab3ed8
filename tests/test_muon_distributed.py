"""Muon on DTensors in every layout FSDP2, TP and EP produce, against one process.

Gloo ranks are spawned on the CPU, once per world size; each runs every scenario and writes what
it saw to a JSON file, and the tests below read those files. The parameters are DTensors made
with `distribute_tensor` and the gradients are set directly, so the optimizer is tested alone:
after three steps every parameter must equal the single-process run (fp32 Newton-Schulz).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils.flop_counter import FlopCounterMode

from trinity_harness.ranks import init_gloo
from trinity_train.optim.muon import Muon

SHAPES = {
    "q_proj": (12, 8),
    "o_proj": (8, 12),
    "odd_proj": (7, 5),  # shards unevenly over 2 ranks
    "router": (4, 8),
    "experts_up": (4, 6, 8),
    "experts_down": (4, 8, 6),
    "norm": (8,),
    "embed": (10, 8),
}
ADAMW = ("norm", "embed")
STEPS = 3
R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)

# name -> (mesh shape, mesh dim names, placements of every parameter)
LAYOUTS = {
    "fsdp2": ((2,), ("dp",), {n: (S0,) for n in SHAPES}),
    "tp2": ((2,), ("tp",), {"q_proj": (S0,), "o_proj": (S1,), "odd_proj": (S1,), "router": (R,),
                            "experts_up": (S1,), "experts_down": (S2,), "norm": (R,), "embed": (S0,)}),
    "ep2": ((2,), ("ep",), {n: ((S0,) if n.startswith("experts") else (R,)) for n in SHAPES}),
    # EP over the ranks FSDP uses, TP inside each expert and on attention.
    "tp2xep2": ((2, 2), ("ep", "tp"), {
        "q_proj": (R, S0), "o_proj": (S0, S1), "odd_proj": (S0, S1), "router": (R, R),
        "experts_up": (S0, S1), "experts_down": (S0, S2), "norm": (R, R), "embed": (S0, R)}),
    # What fully_shard makes of TP parameters: FSDP's dim-0 shard interleaves with TP's.
    "fsdp2xtp2": ((2, 2), ("dp", "tp"), {
        "q_proj": (_StridedShard(0, split_factor=2), S0), "o_proj": (S0, S1),
        "odd_proj": (S0, S1), "router": (S0, R), "experts_up": (_StridedShard(1, split_factor=2), S1),
        "experts_down": (S0, S2), "norm": (S0, R), "embed": (S0, R)}),
    # FSDP on expert weights: over whole experts (no communication) or inside each expert.
    "fsdp2xep2": ((2, 2), ("dp", "ep"), {
        "q_proj": (S0, S0), "o_proj": (S0, S1), "odd_proj": (R, S0), "router": (S0, R),
        "experts_up": (_StridedShard(0, split_factor=2), S0), "experts_down": (S1, S0),
        "norm": (R, R), "embed": (S0, S0)}),
}


class Toy(nn.Module):
    def __init__(self, values: dict[str, torch.Tensor]):
        super().__init__()
        for name, value in values.items():
            self.register_parameter(name, nn.Parameter(value))


def initial_values() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def step_grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def make_optimizer(model: Toy) -> Muon:
    params = dict(model.named_parameters())
    return Muon([{"params": [p for n, p in params.items() if n not in ADAMW], "kind": "muon"},
                 {"params": [params[n] for n in ADAMW], "kind": "adamw", "lr": 3e-3}],
                lr=0.02, weight_decay=0.1, ns_dtype="fp32")


def reference_run(steps: int, drop=None) -> Toy:
    """One process, plain tensors. `drop(step, name, grad)` edits or removes (None) a gradient."""
    model = Toy(initial_values())
    opt = make_optimizer(model)
    for step in range(steps):
        grads = step_grads(step)
        for name, p in model.named_parameters():
            p.grad = drop(step, name, grads[name]) if drop else grads[name]
        opt.step()
    return model


def distributed_model(layout: str) -> tuple[Toy, object]:
    mesh_shape, names, placements = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    values = {n: distribute_tensor(v, mesh, placements[n], src_data_rank=None)
              for n, v in initial_values().items()}
    return Toy(values), mesh


def set_distributed_grads(model: Toy, step: int) -> None:
    grads = step_grads(step)
    for name, p in model.named_parameters():
        p.grad = distribute_tensor(grads[name], p.device_mesh, p.placements, src_data_rank=None)


def max_relative_error(model: Toy, reference: Toy) -> float:
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        worst = max(worst, ((full - ref[name]).norm() / ref[name].norm()).item())
    return worst


# ------------------------------------------------------------------------------ scenarios


def scenario_layouts(layouts):
    def run(rank, world, out_dir):
        errors = {}
        for layout in layouts:
            model, _ = distributed_model(layout)
            opt = make_optimizer(model)
            for step in range(STEPS):
                set_distributed_grads(model, step)
                opt.step()
            errors[layout] = max_relative_error(model, reference_run(STEPS))
        return errors
    return run


def scenario_expert_without_tokens(rank, world, out_dir):
    """ep2: at step 1, rank 1's experts got no tokens (no grad there); at step 2 nobody's did."""
    model, mesh = distributed_model("ep2")
    opt = make_optimizer(model)
    for step in range(STEPS):
        set_distributed_grads(model, step)
        if step == 1 and rank == 1:
            model.experts_up.grad = None
        if step == 2:
            model.experts_down.grad = None
        opt.step()

    def drop(step, name, grad):
        if step == 1 and name == "experts_up":
            grad = grad.clone()
            grad[2:] = 0  # rank 1 holds experts 2 and 3
        if step == 2 and name == "experts_down":
            return None
        return grad

    return max_relative_error(model, reference_run(STEPS, drop))


def scenario_work_split(rank, world, out_dir):
    """Newton-Schulz FLOPs this rank performs, next to one process doing all of them."""
    model, _ = distributed_model("fsdp2")
    opt = make_optimizer(model)
    set_distributed_grads(model, 0)
    with FlopCounterMode(display=False) as counter:
        opt.step()
    mine = counter.get_total_flops()
    ref_model = Toy(initial_values())
    ref_opt = make_optimizer(ref_model)
    for name, p in ref_model.named_parameters():
        p.grad = step_grads(0)[name]
    with FlopCounterMode(display=False) as counter:
        ref_opt.step()
    return {"rank": mine, "single_process": counter.get_total_flops()}


def scenario_checkpoint(rank, world, out_dir):
    """Two steps in the fsdp2 layout, saved with DCP; reloaded under tp2 for the third step."""
    model, _ = distributed_model("fsdp2")
    opt = make_optimizer(model)
    for step in range(2):
        set_distributed_grads(model, step)
        opt.step()
    ckpt = str(Path(out_dir) / "ckpt")
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=ckpt)

    resumed, _ = distributed_model("tp2")
    resumed_opt = make_optimizer(resumed)
    state = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, resumed_opt)}
    dcp.load(state, checkpoint_id=ckpt)
    set_model_state_dict(resumed, state["model"])
    set_optimizer_state_dict(resumed, resumed_opt, state["optim"])
    set_distributed_grads(resumed, 2)
    resumed_opt.step()
    return max_relative_error(resumed, reference_run(STEPS))


def scenario_packed_exchange(rank, world, out_dir):
    """fsdp2 (a gather group of one mesh dim: `optim/muon_exchange.py`): the collectives of one
    Muon step, and three steps with every matrix in a chunk of its own."""
    from trinity_train.optim import muon_exchange
    from trinity_train.plan.collectives import CollectiveLog

    model, _ = distributed_model("fsdp2")
    opt = make_optimizer(model)
    set_distributed_grads(model, 0)
    hooked = []  # the calls already issued each time the hook runs
    with CollectiveLog() as log:
        handle = opt.register_while_orthogonalising_hook(lambda: hooked.append(len(log.calls)))
        opt.step()
        handle.remove()
    kinds = sorted(c.kind for c in log.calls)
    saved = muon_exchange.EXCHANGE_BYTES
    muon_exchange.EXCHANGE_BYTES = 1
    try:
        model, _ = distributed_model("fsdp2")
        opt = make_optimizer(model)
        with CollectiveLog() as log:
            opt.register_while_orthogonalising_hook(lambda: hooked.append(len(log.calls)))
            for step in range(STEPS):
                set_distributed_grads(model, step)
                opt.step()
        chunked_calls = len(log.calls)
    finally:
        muon_exchange.EXCHANGE_BYTES = saved
    return {"kinds": kinds, "chunked_calls": chunked_calls, "hooked": hooked,
            "chunked_error": max_relative_error(model, reference_run(STEPS))}


SCENARIOS = {
    "layouts_2": scenario_layouts(["fsdp2", "tp2", "ep2"]),
    "layouts_4": scenario_layouts(["tp2xep2", "fsdp2xtp2", "fsdp2xep2"]),
    "expert_without_tokens": scenario_expert_without_tokens,
    "work_split": scenario_work_split,
    "checkpoint": scenario_checkpoint,
    "packed_exchange": scenario_packed_exchange,
}


def _run_scenarios(out_dir, scenarios):
    init_gloo()
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name in scenarios:
        try:
            results[name] = {"value": SCENARIOS[name](rank, world, out_dir)}
        except Exception as e:  # reported per scenario by the tests below
            results[name] = {"error": f"{type(e).__name__}: {e}"}
    return results


@pytest.fixture(scope="module")
def two_ranks(rank_pool):
    with tempfile.TemporaryDirectory() as out_dir:
        results = rank_pool(2).run(_run_scenarios, out_dir, ["layouts_2", "expert_without_tokens", "work_split",
                                                         "checkpoint", "packed_exchange"])
        yield results, out_dir


@pytest.fixture(scope="module")
def four_ranks(rank_pool):
    with tempfile.TemporaryDirectory() as out_dir:
        yield rank_pool(4).run(_run_scenarios, out_dir, ["layouts_4"])


def _values(results, scenario):
    for rank, res in enumerate(results):
        assert "error" not in res[scenario], f"rank {rank}: {res[scenario]['error']}"
    return [res[scenario]["value"] for res in results]


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "ep2"])
def test_two_rank_layouts_equal_single_process(two_ranks, layout):
    results, _ = two_ranks
    for errors in _values(results, "layouts_2"):
        assert errors[layout] <= 1e-4


@pytest.mark.parametrize("layout", ["tp2xep2", "fsdp2xtp2", "fsdp2xep2"])
def test_four_rank_layouts_equal_single_process(four_ranks, layout):
    for errors in _values(four_ranks, "layouts_4"):
        assert errors[layout] <= 1e-4


def test_expert_without_tokens_neither_hangs_nor_desynchronises(two_ranks):
    results, _ = two_ranks
    assert max(_values(results, "expert_without_tokens")) <= 1e-4


def test_each_matrix_is_orthogonalised_once(two_ranks):
    results, _ = two_ranks
    flops = _values(results, "work_split")
    total = flops[0]["single_process"]
    assert total > 0
    assert sum(f["rank"] for f in flops) == total  # nobody repeats anybody's work
    assert max(f["rank"] for f in flops) <= 0.55 * total  # and it is split about evenly


def test_state_reloads_under_another_layout(two_ranks):
    results, _ = two_ranks
    assert max(_values(results, "checkpoint")) <= 1e-4


def test_state_saved_by_two_ranks_reloads_into_one_process(two_ranks):
    results, out_dir = two_ranks
    _values(results, "checkpoint")  # the two ranks saved it
    model = Toy(initial_values())
    opt = make_optimizer(model)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=str(Path(out_dir) / "ckpt"))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    for name, p in model.named_parameters():
        p.grad = step_grads(2)[name]
    opt.step()
    assert max_relative_error(model, reference_run(STEPS)) <= 1e-4


def test_muon_exchanges_a_one_dim_group_in_two_all_to_alls(two_ranks):
    """FSDP's gather group is one mesh dim: the four split matrices (the expert stacks are split
    along the expert dim, so each rank has whole experts) go to their owners and come back in
    all-to-alls, one each way per wave (`cut_waves`: four matrices, largest first, make four waves)
    (not two DTensor redistributions per round, which a CPU mesh sends as all-gathers); cut into
    chunks of one matrix each, the result is still one process's."""
    results, _ = two_ranks
    for value in _values(results, "packed_exchange"):
        assert value["kinds"] == ["all_to_all"] * 2 * 4
        assert value["chunked_calls"] == STEPS * 2 * 4  # four split matrices, a chunk each
        # The training step's hook (the next forward's first all-gathers) runs once a step, after
        # every wave's pieces of the first chunk have left and before any result comes back.
        assert value["hooked"] == [4] + [2 * 4 * step + 1 for step in range(STEPS)]
        assert value["chunked_error"] <= 1e-4
