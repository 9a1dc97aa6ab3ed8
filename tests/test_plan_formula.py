"""The closed-form model (plan/formula.py) agrees with the trace of the real code (plan/trace.py)
within 10 % on the peak and on the FSDP, EP and Muon bytes, for small traced cases."""

import functools

import pytest

from trinity_train.config import load_config
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.plan.collectives import (CP_CATEGORY, EP_ALL_TO_ALL, FSDP_ALL_GATHER, FSDP_ALL_REDUCE,
                                            FSDP_EMBEDDING_ROWS_GATHER, FSDP_EMBEDDING_ROWS_REDUCE, FSDP_REDUCE_SCATTER,
                                            MUON_REDISTRIBUTE, sent_by_category)
from trinity_train.plan.formula import memory_per_rank, traffic_per_rank
from trinity_train.plan.trace import trace_rank

AC = "--train.activation_checkpointing=true"
BF16_WIRE = ["--parallel.ep_wire_dtype=bf16", "--parallel.reduce_wire_dtype=bf16"]
CASES = [
    pytest.param(["--parallel.ep=2"], False, id="fsdp2-ep2"),
    pytest.param(["--parallel.ep=2", AC], False, id="fsdp2-ep2-ac"),
    # The peak in the backward of the first block (benchmarks/README.md section 16).
    pytest.param(["--parallel.dp_shard=2", AC, "--train.global_batch_size=4", "--train.micro_batch_size=2"], False,
                 id="fsdp2-ac"),
    # Two micro-batches reduced once (parallel.sync_every_micro_batch): the whole gradients kept.
    pytest.param(["--parallel.dp_shard=2", "--train.global_batch_size=32", "--parallel.sync_every_micro_batch=false"],
                 False, id="fsdp2-sync-last"),
    # Every block kept gathered from its forward to its backward: no all-gather in backward (the
    # default model's blocks fit parallel.keep_gathered_gib's default too). The reshard policy's
    # budget: none but the last block (0), or the last three of an EP job's (blocks of 3.3, 2.9,
    # 2.9 and 2.9 MiB a rank: 0.006 GiB takes blocks 2 and 1 below the last, not block 0).
    pytest.param(["--parallel.dp_shard=2", "--parallel.keep_gathered_gib=inf"], False, id="fsdp2-no-reshard"),
    pytest.param(["--parallel.dp_shard=2", "--parallel.keep_gathered_gib=0"], False, id="fsdp2-reshard"),
    pytest.param(["--parallel.ep=2", "--parallel.keep_gathered_gib=0.006"], False, id="fsdp2-ep2-keep-three"),
    # GPU numerics: bf16, the memory-efficient kernel's expanded kv heads and converted mask.
    pytest.param(["--parallel.dp_shard=2", "--train.dtype=bf16"], True, id="fsdp2-gpu-bf16"),
    # bf16 on the wire: the EP all-to-alls and the reduce-scatter (CPU: cast by the all-to-all
    # reduce-scatter; GPU: by FSDP's reduce dtype, its buffers bf16), HSDP's all-reduce.
    pytest.param(["--parallel.ep=2", *BF16_WIRE], False, id="fsdp2-ep2-bf16-wire"),
    pytest.param(["--parallel.ep=2", *BF16_WIRE], True, id="fsdp2-ep2-gpu-bf16-wire"),
    pytest.param(["--parallel.dp_replicate=2", "--parallel.dp_shard=1", *BF16_WIRE], False, id="hsdp2-bf16-wire"),
]


@functools.cache
def _traced(overrides: tuple[str, ...], gpu: bool):
    """Rank 0 of 2 traced (once per module: the halving test reads the same traces)."""
    return trace_rank(load_config(None, list(overrides)), 2, 0, gpu=gpu)


@pytest.mark.parametrize("overrides, gpu", CASES)
def test_formula_agrees_with_the_trace(overrides, gpu):
    cfg = load_config(None, overrides)
    traced = _traced(tuple(overrides), gpu)
    dims = ParallelDims.from_config(cfg, 2)
    # The trace is a steady-state iteration: the optimizer state exists before its forward.
    model = memory_per_rank(cfg, dims, gpu=gpu)
    assert model.peak == pytest.approx(traced.peak, rel=0.10)
    assert_bytes_agree(cfg, dims, traced, gpu, rel=0.10)


FLOW_CATEGORIES = (FSDP_ALL_GATHER, FSDP_REDUCE_SCATTER, FSDP_EMBEDDING_ROWS_GATHER, FSDP_EMBEDDING_ROWS_REDUCE,
                   FSDP_ALL_REDUCE, EP_ALL_TO_ALL, MUON_REDISTRIBUTE)


def assert_bytes_agree(cfg, dims, traced, gpu: bool, rel: float) -> None:
    """The closed form's bytes per collective category within `rel` of the trace's."""
    sent = sent_by_category(traced.collectives)
    predicted = sent_by_category(traffic_per_rank(cfg, dims, gpu=gpu))
    for category in FLOW_CATEGORIES:
        assert predicted.get(category, 0) == pytest.approx(sent.get(category, 0), rel=rel), category


# Context parallelism: the halo exchange and the key/value all-gather (model/context_attention.py).
CP_LONG = ["--data.seq_len=4096", "--train.micro_batch_size=1", "--train.global_batch_size=1", "--model.doc_masking=true"]
CP_CASES = [
    pytest.param(["--parallel.cp=2"], 2, id="cp2"),
    pytest.param(["--parallel.cp=2", "--parallel.ep=2", AC], 2, id="cp2-ep2-ac", marks=pytest.mark.slow),
    pytest.param(["--parallel.cp=2", *CP_LONG], 2, id="cp2-4096-docs", marks=pytest.mark.slow),
    pytest.param(["--parallel.cp=4", *CP_LONG], 4, id="cp4-4096-docs", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("overrides, world", CP_CASES)
def test_formula_agrees_with_the_trace_under_context_parallelism(overrides, world):
    cfg = load_config(None, overrides)
    traced = trace_rank(cfg, world, 0, gpu=False)
    dims = ParallelDims.from_config(cfg, world)
    assert memory_per_rank(cfg, dims, gpu=False).peak == pytest.approx(traced.peak, rel=0.10)
    sent = sent_by_category(traced.collectives)
    predicted = sent_by_category(traffic_per_rank(cfg, dims, gpu=False))
    assert {c for c in sent if c.startswith("CP ") and sent[c]} >= set(CP_CATEGORY.values()) - {CP_CATEGORY["all_reduce"]}
    for category in (FSDP_ALL_GATHER, FSDP_REDUCE_SCATTER, EP_ALL_TO_ALL, MUON_REDISTRIBUTE, *CP_CATEGORY.values()):
        if category != CP_CATEGORY["all_reduce"]:  # the MoE losses' sums: none with the default's aux and z losses off
            assert predicted.get(category, 0) == pytest.approx(sent.get(category, 0), rel=0.10), category


def test_context_parallelism_divides_the_activations():
    """The closed form's activations at a long row fall about as 1/cp (the keys and values a
    global layer gathers do not)."""
    acts = {}
    for cp in (1, 2, 4):
        cfg = load_config(None, [f"--parallel.cp={cp}", "--data.seq_len=16384", "--train.micro_batch_size=1",
                                 "--train.global_batch_size=1", "--model.doc_masking=true"])
        acts[cp] = memory_per_rank(cfg, ParallelDims.from_config(cfg, cp), gpu=False).moments["end of forward"]["activations"]
    assert 1.7 < acts[1] / acts[2] < 2.1 and 3.2 < acts[1] / acts[4] < 4.2


@pytest.mark.parametrize("gpu", [False, True])
def test_bf16_on_the_wire_halves_the_traced_bytes_it_names(gpu):
    """The real code's collectives, traced: the EP all-to-alls and the reduce-scatters send half
    the bytes, the all-gathers and Muon's exchanges the same."""
    fp32 = sent_by_category(_traced(("--parallel.ep=2",), gpu).collectives)
    bf16 = sent_by_category(_traced(("--parallel.ep=2", *BF16_WIRE), gpu).collectives)
    assert fp32.keys() == bf16.keys()
    for category in fp32:
        halved = category in (EP_ALL_TO_ALL, FSDP_REDUCE_SCATTER, FSDP_EMBEDDING_ROWS_REDUCE)
        assert bf16[category] == fp32[category] / (2 if halved else 1) > 0, category


def test_steady_state_holds_the_optimizer_state_through_backward():
    cfg = load_config(None, [])
    dims = ParallelDims.one_process()
    first = memory_per_rank(cfg, dims, gpu=False, steady=False)
    later = memory_per_rank(cfg, dims, gpu=False)
    for moment in ("end of forward", "backward"):
        assert later.moments[moment]["optimizer state"] > 0
        assert first.moments[moment]["optimizer state"] == 0
    assert later.peak > first.peak


# Experts gathered once a step (parallel.expert_gather = "step"), four micro-batches a rank: with
# EP (experts over efsdp = 2), on a GPU's numerics too, and under HSDP without EP (the experts
# their own unit over the shard group).
EXPERTS_ONCE = ["--parallel.expert_gather=step", "--train.micro_batch_size=1", "--train.global_batch_size=16"]


@pytest.mark.parametrize("overrides, gpu", [
    pytest.param(["--parallel.ep=2"], False, id="fsdp4-ep2"),
    pytest.param(["--parallel.ep=2", "--train.dtype=bf16"], True, id="fsdp4-ep2-gpu-bf16"),
    pytest.param(["--parallel.dp_replicate=2", "--parallel.dp_shard=2"], False, id="hsdp2x2"),
])
def test_experts_gathered_once_a_step_agree_with_the_trace_line_by_line(overrides, gpu):
    from trinity_train.plan.report import disagrees
    from trinity_train.plan.trace import CATEGORIES

    cfg = load_config(None, [*overrides, *EXPERTS_ONCE])
    traced = trace_rank(cfg, 4, 0, gpu=gpu)
    dims = ParallelDims.from_config(cfg, 4)
    model = memory_per_rank(cfg, dims, gpu=gpu)
    for category in CATEGORIES:
        assert not disagrees(traced.memory[category], model.by_category[category], traced.peak), category
    assert model.peak == pytest.approx(traced.peak, rel=0.10)
    assert_bytes_agree(cfg, dims, traced, gpu, rel=0.05)
    # One all-gather and one reduce-scatter of each MoE layer's experts a step, not one per micro-batch.
    moe_layers = cfg.model.num_layers - cfg.model.num_dense_layers
    if dims.ep > 1:  # (without EP the experts' group is the shard group, named dp_shard)
        experts = [c.category for c in traced.collectives if c.dim == "efsdp"]
        assert sorted(experts) == [FSDP_ALL_GATHER] * moe_layers + [FSDP_REDUCE_SCATTER] * moe_layers


def test_experts_gathered_once_a_step_trade_memory_for_traffic():
    """The closed form at four micro-batches: a quarter of the experts' all-gather and
    reduce-scatter bytes, for their gathered weights and unsharded gradients held through the step."""
    each = load_config(None, ["--parallel.ep=2", *EXPERTS_ONCE[1:]])
    once = load_config(None, ["--parallel.ep=2", *EXPERTS_ONCE])
    dims = ParallelDims.from_config(each, 4)

    def expert_bytes(cfg):
        return sum(f.sent for f in traffic_per_rank(cfg, dims, gpu=False) if f.dim == "efsdp")

    assert expert_bytes(once) == pytest.approx(expert_bytes(each) / 4)
    assert memory_per_rank(once, dims, gpu=False).peak > memory_per_rank(each, dims, gpu=False).peak
