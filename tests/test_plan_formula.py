"""The closed-form model (plan/formula.py) agrees with the trace of the real code (plan/trace.py)
within 10 % on the peak and on the FSDP, EP and Muon bytes, for small traced cases."""

import pytest

from trinity_train.config import load_config
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.plan.collectives import (EP_ALL_TO_ALL, FSDP_ALL_GATHER, FSDP_REDUCE_SCATTER, MUON_REDISTRIBUTE,
                                            sent_by_category)
from trinity_train.plan.formula import memory_per_rank, traffic_per_rank
from trinity_train.plan.trace import trace_rank

AC = "--train.activation_checkpointing=true"
CASES = [
    pytest.param(["--parallel.ep=2"], False, id="fsdp2-ep2"),
    pytest.param(["--parallel.ep=2", AC], False, id="fsdp2-ep2-ac"),
    # The peak in the backward of the first block (benchmarks/README.md section 16).
    pytest.param(["--parallel.dp_shard=2", AC, "--train.global_batch_size=4", "--train.micro_batch_size=2"], False,
                 id="fsdp2-ac"),
    # Two micro-batches reduced once (parallel.sync_every_micro_batch): the whole gradients kept.
    pytest.param(["--parallel.dp_shard=2", "--train.global_batch_size=32", "--parallel.sync_every_micro_batch=false"],
                 False, id="fsdp2-sync-last"),
    # Every block kept gathered from its forward to its backward: no all-gather in backward.
    pytest.param(["--parallel.dp_shard=2", "--parallel.reshard_after_forward=false"], False, id="fsdp2-no-reshard"),
    # GPU numerics: bf16, the memory-efficient kernel's expanded kv heads and converted mask.
    pytest.param(["--parallel.dp_shard=2", "--train.dtype=bf16"], True, id="fsdp2-gpu-bf16"),
]


@pytest.mark.parametrize("overrides, gpu", CASES)
def test_formula_agrees_with_the_trace(overrides, gpu):
    cfg = load_config(None, overrides)
    traced = trace_rank(cfg, 2, 0, gpu=gpu)
    dims = ParallelDims.from_config(cfg, 2)
    # The trace is a steady-state iteration: the optimizer state exists before its forward.
    model = memory_per_rank(cfg, dims, gpu=gpu)
    assert model.peak == pytest.approx(traced.peak, rel=0.10)
    sent = sent_by_category(traced.collectives)
    predicted = sent_by_category(traffic_per_rank(cfg, dims, gpu=gpu))
    for category in (FSDP_ALL_GATHER, FSDP_REDUCE_SCATTER, EP_ALL_TO_ALL, MUON_REDISTRIBUTE):
        assert predicted.get(category, 0) == pytest.approx(sent.get(category, 0), rel=0.10), category


def test_steady_state_holds_the_optimizer_state_through_backward():
    cfg = load_config(None, [])
    dims = ParallelDims.one_process()
    first = memory_per_rank(cfg, dims, gpu=False, steady=False)
    later = memory_per_rank(cfg, dims, gpu=False)
    for moment in ("end of forward", "backward"):
        assert later.moments[moment]["optimizer state"] > 0
        assert first.moments[moment]["optimizer state"] == 0
    assert later.peak > first.peak
