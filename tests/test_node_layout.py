"""Layouts on nodes (parallel/node_layout.py): the rule that says which groups stay inside a node
agrees with the groups torch's mesh really builds; tp and ep groups across nodes and HSDP shard
groups cut by a node boundary are refused in one line (the allow flag admits the first); HSDP on
4 gloo ranks of 2 "nodes" shards inside a node and replicates across; the ranks per node come
from the config, else the launcher."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trinity_harness.ranks import init_gloo
from trinity_train.errors import ConfigError
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.node_layout import Nodes, layout_on_nodes, nodes_for, within_nodes
from trinity_train.parallel.process_group import init_distributed, nodes_from_env
from trinity_train.plan.fake_world import fake_world
from trinity_train.run_config import load_run_config

DEBUG = Path(__file__).parents[1] / "configs" / "debug.toml"


def cfg_with(**parallel):
    return load_run_config(DEBUG, {"parallel": parallel})


def groups_along(mesh: torch.Tensor, axis: int) -> list[list[int]]:
    """The groups of one dim of a mesh of ranks: every line along `axis`."""
    return mesh.movedim(axis, -1).reshape(-1, mesh.shape[axis]).tolist()


def crosses(group: list[int], per_node: int) -> bool:
    return len({r // per_node for r in group}) > 1


def cut_by_nodes(group: list[int], per_node: int, world: int) -> bool:
    """Neither inside one node nor made of whole nodes."""
    nodes = {r // per_node for r in group}
    whole = set(group) == {r for n in nodes for r in range(n * per_node, min((n + 1) * per_node, world))}
    return len(nodes) > 1 and not whole


def layouts():
    """(world, ranks per node, dp_replicate, cp, tp, ep) over worlds of 4 to 16 ranks and nodes that
    divide them or do not (3 and 6 ranks on 8 or 16); cp = 2 on 8 and 12 ranks only (time)."""
    for world, per_node, dp_replicate, cp, tp, ep in itertools.product((4, 8, 12, 16), (1, 2, 3, 4, 6, 8),
                                                                        (1, 2, 4), (1, 2), (1, 2), (1, 2, 4, 8)):
        if cp > 1 and world not in (8, 12):
            continue
        if world % (dp_replicate * cp * tp) == 0 and (world // dp_replicate // tp) % ep == 0:
            yield world, per_node, dp_replicate, cp, tp, ep


def test_the_rule_agrees_with_the_groups_torch_builds():
    checked = refused = 0
    for world, per_node, dp_replicate, cp, tp, ep in layouts():
        dims = ParallelDims(dp_replicate, world // dp_replicate // cp // tp, tp, ep, world, cp)
        with fake_world(world, 0):
            dims.build_mesh("cpu")
            # every rank, laid out as torch lays them (the data view is (dp, cp, tp) when cp > 1)
            dense, sparse, data = dims._dense.mesh, dims._sparse.mesh, dims._data.mesh
        across = {dim: any(crosses(g, per_node) for g in groups_along(mesh, axis))
                  for dim, mesh, axis in (("tp", dense, 2), ("ep", sparse, 2), ("cp", data, 1)) if mesh.ndim > 2}
        for dim, crossed in across.items():
            assert within_nodes(dim, dims, per_node) == (not crossed), (world, per_node, dims, dim)
        shards_cut = dp_replicate > 1 and any(cut_by_nodes(g, per_node, world)
                                              for g in dense.reshape(dp_replicate, -1).tolist())
        for allow in (False, True):
            cfg = cfg_with(dp_replicate=dp_replicate, cp=cp, tp=tp, ep=ep, allow_ep_tp_across_nodes=allow)
            want_refused = shards_cut or (not allow and any(across.values()))
            try:
                layout_on_nodes(cfg, world, Nodes(per_node, "test"))
                got_refused = False
            except ConfigError as e:
                got_refused = True
                assert "\n" not in str(e) and str(e).startswith("parallel.")
            assert got_refused == want_refused, (world, per_node, dp_replicate, cp, tp, ep, allow)
            checked += 1
            refused += got_refused
    assert checked > 200 and 0 < refused < checked  # both verdicts are exercised


def test_ep_across_nodes_is_refused_unless_asked():
    one_rank_per_node = Nodes(1, "LOCAL_WORLD_SIZE, the launcher's processes per node")
    with pytest.raises(ConfigError) as err:
        layout_on_nodes(cfg_with(ep=2), 2, one_rank_per_node)
    message = str(err.value)
    assert message.startswith("parallel.ep: ep=2 would put its groups across nodes: each spans ep x tp = 2 "
                              "neighbouring ranks, which nodes of 1 ranks (LOCAL_WORLD_SIZE")
    assert "MoE layer's token all-to-alls" in message and "parallel.allow_ep_tp_across_nodes=true" in message
    dims = layout_on_nodes(cfg_with(ep=2, allow_ep_tp_across_nodes=True), 2, one_rank_per_node)
    assert dims.ep == 2
    # 2 ranks per node: the expert groups {0, 1} and {2, 3} are each a node's.
    assert layout_on_nodes(cfg_with(ep=2), 4, Nodes(2, "test")).efsdp == 2
    with pytest.raises(ConfigError, match=r"^parallel.tp: tp=2 would put its groups across nodes"):
        layout_on_nodes(cfg_with(tp=2), 4, Nodes(1, "test"))


def test_hsdp_shards_cut_by_a_node_boundary_are_refused():
    # 12 ranks, 4 per node: shard groups of 6 ranks straddle nodes 0-1 and 1-2.
    with pytest.raises(ConfigError, match=r"^parallel.dp_shard: HSDP's shard groups \(dp_shard x cp x tp = 6 "
                                          r"neighbouring ranks\) are cut by the boundaries of nodes of 4"):
        layout_on_nodes(cfg_with(dp_replicate=2), 12, Nodes(4, "test"))
    # Shard groups inside a node, or of whole nodes, and FSDP alone over any nodes, are fine.
    for dp_replicate, world, per_node in ((2, 8, 4), (2, 16, 4), (1, 12, 8)):
        layout_on_nodes(cfg_with(dp_replicate=dp_replicate), world, Nodes(per_node, "test"))


def test_the_ranks_per_node_come_from_the_config_else_the_launcher(monkeypatch):
    assert nodes_for(cfg_with(ranks_per_node=4).parallel, 8, "launcher") == Nodes(4, "parallel.ranks_per_node")
    assert nodes_for(cfg_with().parallel, 8, "launcher") == Nodes(8, "launcher")
    assert nodes_for(cfg_with().parallel, 0, "launcher") is None  # not known: nothing checked
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert nodes_from_env(cfg_with()).ranks == 2
    with pytest.raises(ConfigError, match=r"parallel.ranks_per_node: must be >= 1, or 0"):
        cfg_with(ranks_per_node=-1)


def test_init_distributed_refuses_ep_across_nodes_before_joining(monkeypatch):
    # torchrun's environment for 2 nodes of 1 rank, with no rendezvous: the refusal must come first.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match=r"parallel.ep: ep=2 would put its groups across nodes"):
        init_distributed(cfg_with(ep=2))
    assert not dist.is_initialized()


def _hsdp_groups_on_two_nodes() -> dict:
    """HSDP 2 x 2 with ep 2 on 4 ranks said to be 2 nodes of 2 (as a launcher would say them)."""
    init_gloo()
    cfg = cfg_with(dp_replicate=2, dp_shard=2, ep=2, ranks_per_node=2)
    dims = layout_on_nodes(cfg, dist.get_world_size(), nodes_from_env(cfg))
    dims.build_mesh("cpu")

    def ranks(mesh) -> list[int]:
        return dist.get_process_group_ranks(mesh.get_group())
    return {"shard": ranks(dims.fsdp_mesh["dp_shard"]), "replicas": ranks(dims.fsdp_mesh["dp_replicate"]),
            "ep": ranks(dims.expert_mesh["ep"])}


@pytest.mark.slow  # four-rank HSDP steps (~11 s); the placement rule itself is checked fast above
def test_hsdp_shards_inside_a_node_and_replicates_across(rank_pool):
    by_rank = rank_pool(4).run(_hsdp_groups_on_two_nodes)
    assert [g["shard"] for g in by_rank] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # node 0, node 1
    assert [g["ep"] for g in by_rank] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["replicas"] for g in by_rank] == [[0, 2], [1, 3], [0, 2], [1, 3]]  # one rank of each node
