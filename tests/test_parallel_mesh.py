"""The parallel layout: size resolution, rejection of impossible layouts before any work, and the
rank groups of the mesh views."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from trinity_harness.ranks import init_gloo
from trinity_train.run_config import load_run_config
from trinity_train.errors import ConfigError, UserError
from trinity_train.parallel.mesh import ParallelDims, expert_shard_dim
from trinity_train.parallel.process_group import init_distributed

DEBUG = Path(__file__).parents[1] / "configs" / "debug.toml"
LARGE = Path(__file__).parents[1] / "configs" / "large.toml"


def cfg_with(**parallel):
    return load_run_config(DEBUG, {"parallel": parallel})


def test_dp_shard_minus_one_takes_what_is_left():
    dims = ParallelDims.from_config(cfg_with(dp_replicate=2, tp=2), world_size=16)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.ep) == (2, 4, 2, 1)
    assert dims.dp == 8
    dims = ParallelDims.from_config(cfg_with(ep=4), world_size=8)
    assert (dims.dp_shard, dims.ep, dims.efsdp) == (8, 4, 2)


def test_world_size_that_is_not_the_product_is_rejected():
    with pytest.raises(ConfigError, match=r"dp_replicate=1 x dp_shard=2 x tp=2 = 4 ranks, but 8 "
                                          r"processes were started"):
        ParallelDims.from_config(cfg_with(dp_shard=2, tp=2), world_size=8)
    with pytest.raises(ConfigError, match=r"6 ranks cannot be split into dp_replicate=2 x tp=2 = 4"):
        ParallelDims.from_config(cfg_with(dp_replicate=2, tp=2), world_size=6)


def test_ep_must_divide_the_expert_data_parallel_size():
    with pytest.raises(ConfigError, match=r"ep=4 must divide the expert-data-parallel size "
                                          r"dp_shard=2"):
        ParallelDims.from_config(cfg_with(ep=4, tp=2), world_size=4)
    with pytest.raises(ConfigError, match=r"parallel.ep: ep=4 must divide the expert-data-parallel"):
        cfg_with(ep=4, dp_shard=2)  # known without a world size: rejected at load


@pytest.mark.parametrize("local_experts, efsdp, width, dim", [
    (32, 64, 3072, 1),  # configs/large.toml on 512 ranks: dim 0 would pad 32 experts to 64 slices
    (1, 2, 16, 1),      # one expert per ep rank over two FSDP ranks
    (3, 2, 16, 1),      # fewer ranks than experts, but uneven: dim 0 pads 3 to 4
    (3, 2, 15, 0),      # ... and dim 1 cannot be split evenly either: FSDP pads dim 0
    (1, 2, 15, 0),
    (32, 8, 3072, 0),   # even: whole experts on every rank
    (4, 4, 16, 0),
    (5, 1, 7, 0),       # one FSDP rank: nothing is split
])
def test_experts_shard_along_dim_1_only_where_dim_0_would_pad(local_experts, efsdp, width, dim):
    assert expert_shard_dim(local_experts, efsdp, width) == dim


def test_layout_description_says_how_experts_are_sharded():
    large = load_run_config(LARGE, {})
    dims = ParallelDims.from_config(large, world_size=512)
    assert dims.expert_shard_dims(large.model) == {"gate_proj": 1, "up_proj": 1, "down_proj": 1}
    assert dims.describe(large.model).endswith(
        "(ep=8 x efsdp=64) tp=1; 32 experts per ep rank, FSDP-sharded along dim 1 over 64 ranks")
    dims = ParallelDims.from_config(large, world_size=64)
    assert dims.describe(large.model).endswith("32 experts per ep rank, FSDP-sharded along dim 0 over 8 ranks")
    assert dims.describe() == "world=64 dp_replicate=1 dp_shard=64 (ep=8 x efsdp=8) tp=1"
    # dim 1 of gate/up is the expert width I / tp; of down, the model width d
    cfg = load_run_config(DEBUG, {"parallel": {"tp": 2}, "model": {"num_experts": 6, "hidden_size": 258}})
    dims = ParallelDims.from_config(cfg, world_size=8)
    assert dims.expert_shard_dims(cfg.model) == {"gate_proj": 1, "up_proj": 1, "down_proj": 0}
    assert "gate_proj dim 1, up_proj dim 1, down_proj dim 0 over 4 ranks" in dims.describe(cfg.model)


@pytest.mark.parametrize("overrides, message", [
    ({"parallel": {"tp": 8}}, r"tp=8 must divide model.num_heads=4 and model.num_kv_heads=2"),
    ({"parallel": {"tp": 4}}, r"tp=4 must divide model.num_heads=4 and model.num_kv_heads=2"),
    ({"parallel": {"tp": 2}, "model": {"moe_intermediate_size": 129}},
     r"tp=2 must divide model.moe_intermediate_size=129"),
    ({"parallel": {"tp": 2}, "data": {"seq_len": 255}}, r"tp=2 must divide data.seq_len=255"),
    ({"parallel": {"ep": 3}}, r"ep=3 must divide model.num_experts=8"),
])
def test_model_that_cannot_be_split_is_rejected_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_run_config(DEBUG, overrides)
    assert isinstance(err.value, UserError)
    assert str(err.value).startswith("parallel.")


def test_expert_width_shard_must_suit_the_grouped_gemm():
    cfg = load_run_config(DEBUG, {"model": {"moe_intermediate_size": 48, "num_heads": 8,
                                            "num_kv_heads": 4}, "parallel": {"tp": 4}})
    with pytest.raises(ConfigError, match=r"moe_intermediate_size / tp = 12 must be a multiple of 8"):
        ParallelDims.from_config(cfg, world_size=4)


def test_init_distributed_rejects_a_bad_layout_before_joining(monkeypatch):
    # WORLD_SIZE as torchrun sets it, but no rendezvous exists: joining would hang, so the error
    # must come first.
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"3 processes were started"):
        init_distributed(cfg_with(dp_shard=2))
    assert not dist.is_initialized()


def test_one_process_needs_no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dims, device = init_distributed(cfg_with())
    assert not dims.is_distributed and dims.mesh is None and dims.dp_rank == 0
    assert device.type == "cpu"
    assert not dist.is_initialized()


def _groups(mesh) -> list[int]:
    return dist.get_process_group_ranks(mesh.get_group())


def _mesh_groups() -> dict:
    init_gloo()
    out = {}
    for name, parallel in {"hsdp": {"dp_replicate": 2, "dp_shard": 2},
                           "tp2_ep2": {"tp": 2, "ep": 2},
                           "ep2_fsdp2": {"ep": 2}}.items():
        cfg = cfg_with(**parallel)
        dims = ParallelDims.from_config(cfg, dist.get_world_size())
        dims.build_mesh("cpu")
        fsdp = dims.fsdp_mesh
        out[name] = {
            "dp": _groups(dims.dp_mesh), "dp_rank": dims.dp_rank,
            "fsdp_shape": tuple(fsdp.shape),
            "fsdp_shard": _groups(fsdp["dp_shard"] if fsdp.ndim == 2 else fsdp),
            "tp": _groups(dims.tp_mesh),
            "expert_mesh": None if dims.expert_mesh is None else dims.expert_mesh.mesh_dim_names,
            "ep": _groups(dims.expert_mesh["ep"]) if dims.ep > 1 else None,
            "efsdp": _groups(dims.expert_fsdp_mesh["efsdp"] if dims.dp_replicate > 1
                             else dims.expert_fsdp_mesh),
        }
    return out


@pytest.mark.slow  # ~12 s
def test_mesh_views_group_the_right_ranks(rank_pool):
    by_rank = rank_pool(4).run(_mesh_groups)
    r0, r3 = by_rank[0], by_rank[3]
    # HSDP 2x2: shard within a replica, replicas of the same shard index apart.
    assert r0["hsdp"]["fsdp_shape"] == (2, 2)
    assert r0["hsdp"]["fsdp_shard"] == [0, 1] and r3["hsdp"]["fsdp_shard"] == [2, 3]
    assert r0["hsdp"]["dp"] == [0, 1, 2, 3] and [r["hsdp"]["dp_rank"] for r in by_rank] == [0, 1, 2, 3]
    # tp 2 x ep 2: tp on neighbouring ranks, ep (taken from dp_shard) across them.
    t = [r["tp2_ep2"] for r in by_rank]
    assert t[0]["tp"] == [0, 1] and t[3]["tp"] == [2, 3]
    assert t[0]["ep"] == [0, 2] and t[1]["ep"] == [1, 3]
    assert t[0]["expert_mesh"] == ("ep", "tp") and t[0]["efsdp"] == [0]
    assert [r["dp_rank"] for r in t] == [0, 0, 1, 1], "tp ranks read the same batch slice"
    # ep 2 x efsdp 2 over 4 ranks: experts are sharded over the ranks ep leaves.
    e = [r["ep2_fsdp2"] for r in by_rank]
    assert e[0]["ep"] == [0, 1] and e[0]["efsdp"] == [0, 2] and e[0]["fsdp_shard"] == [0, 1, 2, 3]
