"""`trinity-train plan`: a job of N ranks traced in one process (fake process group, fake
tensors). What a trace finds is checked here where it has an exact answer (the EP dispatch's
bytes under balanced routing, the rank classes of an uneven FSDP split, the refusals); the
agreement with measured runs is tests/test_plan_checks.py's."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import assert_one_line_error, cli_in_process, run_cli
from trinity_train import exit_codes
from trinity_train.cli import build_parser
from trinity_train.parallel.node_layout import Nodes
from trinity_train.plan.hardware import DEFAULT_GPU, DEFAULT_MFU, DEFAULT_NODES, GIB, GPUS
from trinity_train.plan.options import hardware_option, nodes_option
from trinity_train.plan.rank_classes import chunk_length
from trinity_train.plan.report import RULE, TOLERANCE, comparison_warnings, disagrees, fit_verdict, render
from trinity_train.plan.trace import CATEGORIES


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
    # copies (8 x 256 tokens x top 2) x 256 fp32 values, half of them to the other ep rank; each in
    # two waves (expert_parallel.EP_WAVES = 2, 4 local experts), so 24 calls.
    (ep,) = [r for r in eight_ranks["traffic"] if r["collective"] == "EP all-to-all"]
    assert ep["calls"] == 24 and ep["dim"] == "ep" and ep["group"] == 2
    assert ep["inside_bytes"] == 12 * 8 * 256 * 2 * 256 * 4 / 2 and ep["across_bytes"] == 0


@pytest.mark.slow  # a second plan through the console script
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


@pytest.mark.slow  # a second plan through the console script
def test_uneven_shards_make_rank_classes():
    # 6 ranks cut the 8192-row embedding into 1366-row chunks, the last one shorter (1362).
    plan = plan_json("--world", "6", "--model.num_experts=6")
    classes = plan["rank_classes"]
    assert len(classes) >= 2 and sum(c["ranks"] for c in classes) == 6
    assert classes[0]["local_parameters"] > classes[-1]["local_parameters"]


def test_an_impossible_layout_is_refused_with_valid_ones_near_it(capsys):
    code, err = cli_in_process(capsys, "plan", "--world", "7", "--parallel.ep=2")
    assert_one_line_error(code, err, 2, "parallel.ep", "valid near it", "--world 6")


def test_ep_across_nodes_is_refused_as_training_refuses_it(capsys):
    code, err = cli_in_process(capsys, "plan", "--world", "4", "--parallel.ep=2", "--gpus-per-node", "1")
    assert_one_line_error(code, err, 2, "parallel.ep: ep=2 would put its groups across nodes", "(--gpus-per-node; 4 nodes)",
                          "parallel.allow_ep_tp_across_nodes=true", "valid near it: --parallel.ep=1")
    # Without --gpus-per-node the plan's nodes are the config's, as training's are.
    code, err = cli_in_process(capsys, "plan", "--world", "4", "--parallel.ep=2", "--parallel.ranks_per_node=1")
    assert_one_line_error(code, err, 2, "parallel.ep: ep=2", "(parallel.ranks_per_node; 4 nodes)")


def test_the_plan_places_ranks_on_the_nodes_training_would():
    def nodes(*argv: str, ranks_per_node: int = 0) -> Nodes:
        args, _ = build_parser(["plan"]).parse_known_args(["plan", *argv])
        return nodes_option(args, ranks_per_node)
    assert nodes() == DEFAULT_NODES and DEFAULT_NODES.ranks == 8
    assert nodes(ranks_per_node=2) == Nodes(2, "parallel.ranks_per_node")
    assert nodes("--gpus-per-node", "4", ranks_per_node=2) == Nodes(4, "--gpus-per-node")


def test_a_bad_routing_assumption_is_one_line(capsys):
    code, err = cli_in_process(capsys, "plan", "--routing", "skew=0.5")
    assert_one_line_error(code, err, 2, "--routing", "skew=F")


@pytest.mark.slow  # two traces of 4 ranks
def test_two_traced_micro_batches_stand_for_the_whole_step():
    from trinity_train.config import load_config
    from trinity_train.plan.trace import trace_rank

    cfg = load_config(None, ["--parallel.ep=2", "--train.grad_accum=3", "--train.micro_batch_size=2"])
    full = trace_rank(cfg, 4, 1, gpu=True, micro_batches=3)
    short = trace_rank(cfg, 4, 1, gpu=True)
    assert (full.micro_batches_traced, short.micro_batches_traced) == (3, 2)
    _assert_stands_for(short, full)


@pytest.mark.slow  # two traces of 4 ranks
def test_three_traced_micro_batches_stand_for_a_step_that_gathers_the_experts_once():
    """The first micro-batch gathers the experts, the last reduces them: the middle one repeats."""
    from trinity_train.config import load_config
    from trinity_train.plan.trace import trace_rank

    cfg = load_config(None, ["--parallel.ep=2", "--train.grad_accum=4", "--train.micro_batch_size=2",
                             "--parallel.expert_gather=step"])
    full = trace_rank(cfg, 4, 1, gpu=True, micro_batches=4)
    short = trace_rank(cfg, 4, 1, gpu=True)
    assert (full.micro_batches_traced, short.micro_batches_traced) == (4, 3)
    _assert_stands_for(short, full)


def _assert_stands_for(short, full) -> None:
    """`short`, a trace of fewer micro-batches, counts the same collectives as the `full` one, and
    misses only the untraced micro-batch's token ids in memory."""

    def calls(trace):
        return sorted((c.category, c.kind, c.dim or "", c.group_ranks, c.sent) for c in trace.collectives)

    assert len(full.collectives) > 3 * 12 and calls(short) == calls(full)
    # The untraced micro-batch's token ids (2 x 256 int64 inputs and labels) are all the memory a
    # full trace sees more: a few KiB of a ~110 MB step.
    untraced_inputs = 2 * 256 * 8 * 2
    assert 0 <= full.memory["activations"] - short.memory["activations"] <= untraced_inputs + 256
    assert {k: v for k, v in short.memory.items() if k != "activations"} == \
        {k: v for k, v in full.memory.items() if k != "activations"}


@pytest.fixture(scope="module")
def hsdp_plans() -> dict:
    """The default model as 2 replica groups of 2 ranks, with 1 and with 4 micro-batches a step,
    and ("once") with 4 whose gradients are reduced after the last only."""
    plans = {accum: plan_json("--world", "4", "--parallel.dp_replicate=2", f"--train.grad_accum={accum}")
             for accum in (1, 4)}
    plans["once"] = plan_json("--world", "4", "--parallel.dp_replicate=2", "--train.grad_accum=4",
                              "--parallel.sync_every_micro_batch=false")
    return plans


@pytest.mark.slow  # two plans of 4 ranks (the fixture)
def test_hsdp_all_reduces_across_replicas_once_per_step(hsdp_plans):
    one, four = ({r["collective"]: r["calls"] for r in hsdp_plans[a]["traffic"]} for a in (1, 4))
    assert four["FSDP reduce-scatter"] == 4 * one["FSDP reduce-scatter"]  # inside the shard group, each micro-batch
    assert four["FSDP all-reduce"] == one["FSDP all-reduce"] > 0  # across replicas, the last micro-batch only


@pytest.mark.slow  # the plans of the fixture
def test_gradients_reduced_once_a_step_when_asked(hsdp_plans):
    def totals(plan) -> dict[str, tuple[int, float]]:  # collective: (calls, bytes)
        out: dict[str, tuple[int, float]] = {}
        for r in plan["traffic"]:
            calls, sent = out.get(r["collective"], (0, 0.0))
            out[r["collective"]] = (calls + r["calls"], sent + r["inside_bytes"] + r["across_bytes"])
        return out

    one, once = totals(hsdp_plans[1]), totals(hsdp_plans["once"])
    for collective in ("FSDP reduce-scatter", "FSDP all-reduce"):  # 4 micro-batches, one reduction
        assert once[collective] == one[collective] and one[collective][0] > 0
    assert once["FSDP all-gather"][0] == 4 * one["FSDP all-gather"][0]  # still gathered per micro-batch


@pytest.mark.slow
def test_muon_sends_nothing_across_hsdp_replicas(hsdp_plans):
    muon = [r for r in hsdp_plans[4]["traffic"] if r["collective"] == "Muon redistribute"]
    assert muon and all("dp_replicate" not in r["dim"] for r in muon)


# ------------------------------------------------------------------ the formula, the GPU, the step time


def test_the_formula_is_printed_beside_the_trace_and_agrees_with_it(eight_ranks):
    (only,) = eight_ranks["rank_classes"]
    formula, totals = eight_ranks["formula"], eight_ranks["traffic_totals"]
    assert set(formula["memory"]) == set(only["memory"]) == set(CATEGORIES)
    assert formula["peak"] == pytest.approx(only["peak"], rel=TOLERANCE)
    for key in ("inside_bytes", "across_bytes"):
        assert totals["formula"][key] == pytest.approx(totals["traced"][key], rel=TOLERANCE)
    assert totals["traced"]["inside_bytes"] == sum(r["inside_bytes"] for r in eight_ranks["traffic"])
    assert eight_ranks["warnings"] == [] and eight_ranks["comparison_rule"] == RULE
    text = render(eight_ranks)
    assert "rank 0     formula" in text and "total (formula)" in text
    assert f"trace vs formula: {RULE}" in text and "they agree on every line" in text


def test_every_line_where_trace_and_formula_disagree_is_a_warning(eight_ranks):
    data = copy.deepcopy(eight_ranks)
    data["formula"]["memory"]["activations"] *= 1.5
    data["formula"]["peak"] = sum(data["formula"]["memory"].values())
    data["traffic_totals"]["formula"]["inside_bytes"] *= 0.5
    data["warnings"] = comparison_warnings(data)
    assert [w.split(":")[0] for w in data["warnings"]] == [
        "memory, rank 0, activations", "memory, rank 0, total", "traffic inside nodes"]
    assert render(data).count("\nwarning: ") == 3


def test_the_rule_tolerates_ten_percent_and_ignores_small_lines():
    assert not disagrees(100, 109, 1000) and disagrees(100, 112, 1000) and disagrees(100, 88, 1000)
    assert not disagrees(5, 50, 10_000)  # both below 1 % of the peak
    assert disagrees(0, 50, 1000)  # the trace has none of what the formula puts at 5 % of the peak


def test_the_reserve_the_fit_and_the_step_time_on_the_default_gpu(eight_ranks):
    (only,) = eight_ranks["rank_classes"]
    fit, st = eight_ranks["fit"], eight_ranks["step_time"]
    assert fit["gpu"] == DEFAULT_GPU and fit["fits"] and fit["memory_bytes"] == GPUS[DEFAULT_GPU].memory_bytes
    (priced,) = fit["classes"]
    assert set(priced["reserve"]) == {"CUDA context", "NCCL buffers", "allocator headroom"}
    assert priced["total_with_reserve"] == pytest.approx(only["peak"] + sum(priced["reserve"].values()))
    hw, traced = GPUS[DEFAULT_GPU], eight_ranks["traffic_totals"]["traced"]
    assert st["mfu"] == DEFAULT_MFU
    assert st["comm_s"] == pytest.approx(traced["inside_bytes"] / hw.intra_bytes_s + traced["across_bytes"]
                                         / hw.inter_bytes_s)
    assert st["overlap_s"] == max(st["compute_s"], st["comm_s"])
    assert st["no_overlap_s"] == pytest.approx(st["compute_s"] + st["comm_s"])
    assert st["tokens_per_s_per_gpu"]["overlap"] > st["tokens_per_s_per_gpu"]["no_overlap"] > 0
    text = render(eight_ranks)
    assert f"reserve: NCCL buffers ({fit['communicators']} communicators)" in text and "total with reserve" in text
    assert f"fits on {DEFAULT_GPU} (" in text
    assert f"step time on {DEFAULT_GPU} at MFU {DEFAULT_MFU:.2f}" in text and "tokens/s per GPU" in text


def test_the_fit_flips_on_a_gpu_given_tiny_memory(eight_ranks):
    args, _ = build_parser(["plan"]).parse_known_args(
        ["plan", "--gpu-memory", "0.5", "--peak-tflops", "989", "--intra-gbps", "450", "--inter-gbps", "400"])
    tiny = hardware_option(args)
    assert tiny.memory_bytes == GIB // 2
    data = copy.deepcopy(eight_ranks)
    data["fit"] = fit_verdict(data["rank_classes"], data["fit"]["communicators"], tiny)
    assert not data["fit"]["fits"]
    assert "does NOT fit on custom: needs" in render(data)


@pytest.mark.parametrize("args,fragments", [
    (["--gpu", "a100"], ["--gpu", "h100, h200, b200, b300"]),
    (["--gpu-memory", "80"], ["--peak-tflops, --intra-gbps, --inter-gbps", "together"]),
    (["--gpu-memory", "lots", "--peak-tflops", "989", "--intra-gbps", "450", "--inter-gbps", "400"],
     ["--gpu-memory 'lots'", "GiB"]),
    (["--mfu", "1.5"], ["--mfu '1.5'", "(0, 1]"]),
    (["--mfu", "0"], ["--mfu '0'", "(0, 1]"]),
    (["--search", "--top", "0"], ["--top '0'", ">= 1"]),
    (["--top", "3"], ["--top", "add --search"]),
    (["--cpu", "--gpu", "h100"], ["--gpu", "--cpu plans a CPU job"]),
    (["--cpu", "--search"], ["--search", "drop --cpu"]),
])
def test_a_bad_gpu_or_pricing_option_is_one_line(capsys, args, fragments):
    code, err = cli_in_process(capsys, "plan", *args)
    assert_one_line_error(code, err, exit_codes.CONFIG, *fragments)


@pytest.mark.slow  # console-script processes (~9 s)
def test_a_bad_option_through_the_console_script():
    done = run_cli("plan", "--mfu", "2", ok=False)
    assert_one_line_error(done.returncode, done.stderr, exit_codes.CONFIG, "--mfu")


def test_a_cpu_plan_has_no_gpu_lines(eight_ranks):
    data = copy.deepcopy(eight_ranks)  # what summary() builds without a GPU (--cpu)
    data["fit"] = data["step_time"] = data["on_every_gpu"] = None
    del data["formula"]["reserve"], data["formula"]["total_with_reserve"]
    text = render(data)
    assert "a CPU plan (--cpu): no fit or step time without a profile of its nodes (--hardware)" in text
    assert "fit on" not in text and "reserve:" not in text and "tokens/s" not in text


def test_one_trace_is_priced_on_every_gpu_of_the_table(eight_ranks):
    rows = {g["gpu"]: g for g in eight_ranks["on_every_gpu"]}
    assert set(rows) == {"h100", "h200", "b200", "b300"}
    # The bytes and the peak do not depend on the GPU; its speed and memory do.
    assert len({g["needed_bytes"] for g in rows.values()}) == 1 and all(g["fits"] for g in rows.values())
    assert rows["h200"]["overlap_s"] == pytest.approx(eight_ranks["step_time"]["overlap_s"])
    assert rows["b200"]["overlap_s"] < rows["h100"]["overlap_s"]  # 2.3x the bf16 peak, 2x NVLink
    assert "the same trace on every GPU of the table" in render(eight_ranks)
