"""`trinity-train plan`: a job of N ranks traced in one process (fake process group, fake
tensors). What a trace finds is checked here where it has an exact answer (the EP dispatch's
bytes under balanced routing, the rank classes of an uneven FSDP split, the refusals); the
agreement with measured runs is tests/test_plan_checks.py's."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import assert_one_line_error, run_cli
from trinity_train.plan.rank_classes import chunk_length


def plan_json(*args) -> dict:
    done = run_cli("plan", *args, "--json")
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def eight_ranks() -> dict:
    """The default model as 8 ranks of FSDP x EP 2 (4 ranks shard each expert)."""
    return plan_json("--world", "8", "--parallel.ep=2")


def test_the_layout_and_one_rank_class(eight_ranks):
    lay = eight_ranks["layout"]
    assert (lay["world"], lay["dp_shard"], lay["ep"], lay["efsdp"], lay["tp"]) == (8, 8, 2, 4, 1)
    (only,) = eight_ranks["rank_classes"]  # 8 experts: 4 per ep rank, one per efsdp rank; all even
    assert only["ranks"] == 8 and only["peak"] == sum(only["memory"].values()) > 0


def test_ep_bytes_are_the_dispatch_of_balanced_routing(eight_ranks):
    # 3 MoE layers x 4 all-to-alls (dispatch, combine; forward, backward) of the rank's token
    # copies (8 x 256 tokens x top 2) x 256 fp32 values, half of them to the other ep rank.
    (ep,) = [r for r in eight_ranks["traffic"] if r["collective"] == "EP all-to-all"]
    assert ep["calls"] == 12 and ep["dim"] == "ep" and ep["group"] == 2
    assert ep["inside_bytes"] == 12 * 8 * 256 * 2 * 256 * 4 / 2 and ep["across_bytes"] == 0


def test_groups_that_span_nodes_are_counted_across(eight_ranks):
    across = plan_json("--world", "8", "--parallel.ep=2", "--gpus-per-node", "2")
    rows = {(r["collective"], r["dim"]): r for r in across["traffic"]}
    assert rows[("EP all-to-all", "ep")]["across_bytes"] == 0  # ranks 0, 1: one node of 2
    gather = rows[("FSDP all-gather", "dp_shard")]
    assert gather["inside_bytes"] == 0 and gather["across_bytes"] > 0  # 8 ranks over 4 nodes


@pytest.mark.parametrize("size,parts", [(10, 4), (3, 4), (8, 8), (0, 2), (200192, 512)])
def test_chunk_length_is_torch_chunk(size, parts):
    want = [len(c) for c in torch.arange(size).chunk(parts)] if size else []
    want += [0] * (parts - len(want))
    assert [chunk_length(size, parts, i) for i in range(parts)] == want


def test_uneven_shards_make_rank_classes():
    # 6 ranks cut the 8192-row embedding into 1366-row chunks, the last one shorter (1362).
    plan = plan_json("--world", "6", "--model.num_experts=6")
    classes = plan["rank_classes"]
    assert len(classes) >= 2 and sum(c["ranks"] for c in classes) == 6
    assert classes[0]["local_parameters"] > classes[-1]["local_parameters"]


def test_an_impossible_layout_is_refused_with_valid_ones_near_it():
    done = run_cli("plan", "--world", "7", "--parallel.ep=2", ok=False)
    assert_one_line_error(done.returncode, done.stderr, 2, "parallel.ep", "valid near it", "--world 6")


def test_a_bad_routing_assumption_is_one_line():
    done = run_cli("plan", "--routing", "skew=0.5", ok=False)
    assert_one_line_error(done.returncode, done.stderr, 2, "--routing", "skew=F")


def test_two_traced_micro_batches_stand_for_the_whole_step():
    from trinity_train.config import load_config
    from trinity_train.plan.trace import trace_rank

    cfg = load_config(None, ["--parallel.ep=2", "--train.grad_accum=4", "--train.micro_batch_size=2"])
    full = trace_rank(cfg, 4, 1, gpu=True, micro_batches=4)
    short = trace_rank(cfg, 4, 1, gpu=True)
    assert (full.micro_batches_traced, short.micro_batches_traced) == (4, 2)

    def calls(trace):
        return sorted((c.category, c.kind, c.dim or "", c.group_ranks, c.sent) for c in trace.collectives)

    assert len(full.collectives) > 4 * 12 and calls(short) == calls(full)
    # The untraced micro-batches' token ids (2 x 256 int64 inputs and labels each) are all the
    # memory a full trace sees more: a few KiB of a ~110 MB step.
    untraced_inputs = 2 * (2 * 256 * 8 * 2)
    assert 0 <= full.memory["activations"] - short.memory["activations"] <= untraced_inputs + 256
    assert {k: v for k, v in short.memory.items() if k != "activations"} == \
        {k: v for k, v in full.memory.items() if k != "activations"}


def test_hsdp_all_reduces_across_replicas_once_per_step():
    def calls(grad_accum: int) -> dict:
        plan = plan_json("--world", "4", "--parallel.dp_replicate=2", f"--train.grad_accum={grad_accum}")
        return {r["collective"]: r["calls"] for r in plan["traffic"]}

    one, four = calls(1), calls(4)
    assert four["FSDP reduce-scatter"] == 4 * one["FSDP reduce-scatter"]  # inside the shard group, each micro-batch
    assert four["FSDP all-reduce"] == one["FSDP all-reduce"] > 0  # across replicas, the last micro-batch only


def test_muon_sends_nothing_across_hsdp_replicas():
    plan = plan_json("--world", "4", "--parallel.dp_replicate=2")
    muon = [r for r in plan["traffic"] if r["collective"] == "Muon redistribute"]
    assert muon and all("dp_replicate" not in r["dim"] for r in muon)
