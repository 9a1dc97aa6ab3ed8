"""Muon on the real model under the parallel package, against one process (the issue's acceptance).

The model is built by `parallel.build_parallel_model` (TP, EP, FSDP as training builds it), the
optimizer by `optim.build_optimizer` with `optim.name = "muon"` and fp32 Newton-Schulz. Three
steps on the same global batches must leave every parameter within 1e-4 (relative) of the
single-process run. One layout bans half the experts from routing, so under EP=2 one rank's
experts receive no tokens at all: the ranks must neither hang nor drift apart. And a run saved
after two steps under FSDP2 (through the trainer's checkpoint adapters) and resumed under TP2
must take the third step exactly as the uninterrupted run does.

Expert counts that do not split evenly over the expert-FSDP ranks are sharded along dim 1
(`parallel.mesh.expert_shard_dim`), a matrix dim that Muon gathers: those layouts must match one
process too, hold no padding on any rank, and resume a run saved with the experts on dim 0.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from conftest import RUN_MODEL
from trinity_train.checkpoint import dcp_io
from trinity_train.checkpoint.stateful import ModelState, OptimizerState
from trinity_train.config import load_config
from trinity_train.optim.groups import build_optimizer
from trinity_harness.ranks import init_gloo
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.parallelize import build_parallel_model
from trinity_train.parallel.reductions import sum_over_data_parallel

# The Muon layout matrix (2- and 4-rank pools, the model built under every layout) is slow, like
# the training layout matrix of test_parallel_equivalence.py.
pytestmark = pytest.mark.slow

STEPS = 3
GLOBAL_ROWS = 4
VOCAB = 256
TWO_RANKS = {"fsdp2": {"dp_shard": 2}, "tp2": {"tp": 2}, "ep2": {"ep": 2}, "ep2_idle_rank": {"ep": 2}}
FOUR_RANKS = {"tp2_ep2": {"tp": 2, "ep": 2}, "tp2_fsdp2": {"tp": 2}, "ep2_fsdp2": {"ep": 2},
              # HSDP: each replica group orthogonalises on its own (optim/muon.py REPLICA_DIMS)
              "hsdp2x2_ep2": {"dp_replicate": 2, "dp_shard": 2, "ep": 2}}


# Two experts: one per ep rank under ep=2 x efsdp=2 (the padded layout of configs/large.toml at
# 512 ranks, in small), two over four ranks without ep; three over tp2 x dp_shard=2 (an uneven
# split, on the dim TP splits too); two over tp2 x dp_shard=2 stay on dim 0. The run saved under
# the last resumes under the first.
TWO_EXPERTS = {"num_experts": 2}
THREE_EXPERTS = {"num_experts": 3}
EXPERT_DIM_LAYOUTS = {  # name: (parallel, model, FSDP's dim of the routed experts)
    "ep2_efsdp2": ({"ep": 2}, TWO_EXPERTS, 1),
    "fsdp4_two_experts": ({}, TWO_EXPERTS, 1),
    "tp2_fsdp2_three_experts": ({"tp": 2}, THREE_EXPERTS, 1),
    "tp2_fsdp2_two_experts": ({"tp": 2}, TWO_EXPERTS, 0),
}


def config(parallel: dict, model: dict | None = None):
    return load_config(None, {
        "model": {**RUN_MODEL, "vocab_size": VOCAB, "num_layers": 3, "num_kv_heads": 2, "route_scale": 2.0,
                  "global_every": 2, "load_balance": "none", **(model or {})},
        "data": {"seq_len": 16},
        "train": {"seed": 5},
        # AdamW (embedding, head, norms) with eps 1e-4: gradients that cancel to ~1e-7 differ in
        # their last bits between summation orders, and a tiny eps would turn that into lr-sized
        # steps of either sign.
        "optim": {"name": "muon", "muon_ns_dtype": "fp32", "muon_lr": 2e-2, "lr": 1e-2,
                  "eps": 1e-4, "weight_decay": 0.1},
        "parallel": parallel,
    })


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_ROWS, 17), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def build(cfg, dims: ParallelDims, ban_experts: bool = False):
    model = build_parallel_model(cfg, dims, torch.device("cpu"))
    if ban_experts:  # experts 2 and 3 (rank 1's under ep=2) are never chosen
        for moe in model.moe_layers:
            moe.expert_bias[2:] = -1e4
    return model, build_optimizer(model, cfg.optim)


def train_steps(model, optimizer, dims: ParallelDims, steps: range, ban_experts: bool = False) -> None:
    rows = GLOBAL_ROWS // dims.dp
    lo = dims.dp_rank * rows
    for step in steps:
        tokens, labels = (t[lo:lo + rows] for t in global_batch(step))
        global_tokens = sum_over_data_parallel((labels != -100).sum(), dims)
        out = model(tokens, labels=labels)
        (out.ce_sum / global_tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        if ban_experts:
            counts = sum_over_data_parallel(out.tokens_per_expert, dims)
            assert counts[:, 2:].sum() == 0, "the banned experts were routed to"


def full_params(model) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def train_three_steps(cfg, dims: ParallelDims, ban_experts: bool) -> dict[str, torch.Tensor]:
    model, optimizer = build(cfg, dims, ban_experts)
    train_steps(model, optimizer, dims, range(STEPS), ban_experts)
    return full_params(model)


def mesh_for(parallel: dict, world: int, model: dict | None = None):
    cfg = config(parallel, model)
    dims = ParallelDims.from_config(cfg, world)
    dims.build_mesh("cpu")
    return cfg, dims


def resume_under_another_layout(ckpt_dir, saved_under: dict, resumed_under: dict,
                                model_changes: dict | None = None) -> dict[str, torch.Tensor]:
    """Two steps under one layout, saved; the third after loading under another."""
    world = torch.distributed.get_world_size()
    cfg, dims = mesh_for(saved_under, world, model_changes)
    model, optimizer = build(cfg, dims)
    train_steps(model, optimizer, dims, range(2))
    dcp_io.save({"model": ModelState(model), "optim": OptimizerState(model, optimizer)}, ckpt_dir)

    cfg, dims = mesh_for(resumed_under, world, model_changes)
    model, optimizer = build(cfg, dims)
    dcp_io.load({"model": ModelState(model), "optim": OptimizerState(model, optimizer)}, ckpt_dir)
    train_steps(model, optimizer, dims, range(2, STEPS))
    return full_params(model)


def train_layouts(layouts: dict, ckpt_dir=None) -> dict:
    init_gloo()
    world = torch.distributed.get_world_size()
    results = {}
    for name, parallel in layouts.items():
        cfg, dims = mesh_for(parallel, world)
        results[name] = train_three_steps(cfg, dims, ban_experts=name.endswith("idle_rank"))
    if ckpt_dir is not None:
        results["fsdp2_resumed_as_tp2"] = resume_under_another_layout(ckpt_dir, {"dp_shard": 2}, {"tp": 2})
    return results


def expert_shards(model) -> dict[str, tuple]:
    """Every routed-expert weight's FSDP shard on this rank: (FSDP's shard dim, local size, the
    padded size FSDP allocates and communicates)."""
    names = {id(p): name for name, p in model.named_parameters() if ".experts." in name}
    shards = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    if id(param.sharded_param) in names:
                        shards[names[id(param.sharded_param)]] = (
                            param.fsdp_placement.dim, tuple(param.sharded_param.to_local().shape),
                            tuple(param.padded_sharded_param_size))
    return shards


def train_expert_dim_layouts(ckpt_dir) -> dict:
    """EXPERT_DIM_LAYOUTS trained three steps each ({name: (params, expert_shards)}), and the run
    saved under dim 0 resumed under dim 1."""
    init_gloo()
    world = torch.distributed.get_world_size()
    results = {}
    for name, (parallel, model_changes, _) in EXPERT_DIM_LAYOUTS.items():
        cfg, dims = mesh_for(parallel, world, model_changes)
        model, optimizer = build(cfg, dims)
        shards = expert_shards(model)
        train_steps(model, optimizer, dims, range(STEPS))
        results[name] = (full_params(model), shards)
    results["dim0_resumed_as_dim1"] = resume_under_another_layout(
        ckpt_dir, EXPERT_DIM_LAYOUTS["tp2_fsdp2_two_experts"][0], EXPERT_DIM_LAYOUTS["ep2_efsdp2"][0],
        TWO_EXPERTS)
    return results


def one_process(ban_experts: bool, model_changes: dict | None = None) -> dict[str, torch.Tensor]:
    cfg = config({}, model_changes)
    return train_three_steps(cfg, ParallelDims.from_config(cfg, 1), ban_experts)


@pytest.fixture(scope="module")
def references() -> dict[bool, dict]:
    return {ban: one_process(ban) for ban in (False, True)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, rank_pool) -> list[dict]:
    return rank_pool(2).run(train_layouts, TWO_RANKS, tmp_path_factory.mktemp("muon_ckpt") / "step2")


@pytest.fixture(scope="module")
def four_ranks(rank_pool) -> list[dict]:
    return rank_pool(4).run(train_layouts, FOUR_RANKS)


def assert_equals_one_process(ranks: list[dict], layout: str, reference: dict) -> None:
    for rank, results in enumerate(ranks):
        params = results[layout]
        assert params.keys() == reference.keys()
        for name, want in reference.items():
            err = ((params[name] - want).norm() / want.norm()).item()
            assert err <= 1e-4, f"{layout}, rank {rank}: {name} is {err:.2e} (relative) off one process"


def test_reference_moves_every_muon_matrix(references):
    cfg = config({})
    start = build_parallel_model(cfg, ParallelDims.from_config(cfg, 1), torch.device("cpu"))
    for name, p in start.named_parameters():
        assert not torch.equal(references[False][name], p.detach()), f"{name} never moved"


@pytest.mark.parametrize("layout", list(TWO_RANKS))
def test_two_rank_layout_equals_one_process(two_ranks, references, layout):
    assert_equals_one_process(two_ranks, layout, references[layout.endswith("idle_rank")])


@pytest.mark.parametrize("layout", list(FOUR_RANKS))
def test_four_rank_layout_equals_one_process(four_ranks, references, layout):
    assert_equals_one_process(four_ranks, layout, references[False])


def test_state_saved_under_fsdp_resumes_under_tp(two_ranks, references):
    assert_equals_one_process(two_ranks, "fsdp2_resumed_as_tp2", references[False])


# ------------------------------------------------- experts sharded along dim 1 (no padding)

@pytest.fixture(scope="module")
def expert_dim_runs(tmp_path_factory, rank_pool) -> list[dict]:
    return rank_pool(4).run(train_expert_dim_layouts, tmp_path_factory.mktemp("expert_dim") / "step2")


@pytest.fixture(scope="module")
def expert_references() -> dict[int, dict]:
    return {m["num_experts"]: one_process(False, m) for m in (TWO_EXPERTS, THREE_EXPERTS)}


@pytest.mark.parametrize("layout", list(EXPERT_DIM_LAYOUTS))
def test_expert_shard_dim_layout_equals_one_process(expert_dim_runs, expert_references, layout):
    _, model_changes, _ = EXPERT_DIM_LAYOUTS[layout]
    params_only = [{layout: results[layout][0]} for results in expert_dim_runs]
    assert_equals_one_process(params_only, layout, expert_references[model_changes["num_experts"]])


@pytest.mark.parametrize("layout", list(EXPERT_DIM_LAYOUTS))
def test_expert_shards_are_equal_and_unpadded_on_every_rank(expert_dim_runs, layout):
    _, _, dim = EXPERT_DIM_LAYOUTS[layout]
    first = expert_dim_runs[0][layout][1]
    assert len(first) == 3 * 2  # gate, up and down of both MoE layers
    for rank, results in enumerate(expert_dim_runs):
        shards = results[layout][1]
        assert shards.keys() == first.keys()
        for name, (_, local, padded) in shards.items():
            assert local == padded, f"{layout}, rank {rank}: {name} {local} is padded to {padded}"
            assert local == first[name][1], f"{layout}: rank {rank} holds {local} of {name}"
    assert {shard_dim for shard_dim, _, _ in first.values()} == {dim}


def test_state_saved_with_experts_on_dim_0_resumes_with_them_on_dim_1(expert_dim_runs, expert_references):
    assert_equals_one_process(expert_dim_runs, "dim0_resumed_as_dim1", expert_references[2])
