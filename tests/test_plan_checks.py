"""`trinity-train plan`'s trace against real runs of the same config (issue 29, "Checked against
what can be measured here"): the bytes per collective of benchmarks/multinode.py's job within 5 %,
and the peak memory of one rank within 10 %, both measured in real runs by the planner's own
accounting (`trinity_harness/plan_runs.py`: `CollectiveLog`, and the tracker on the real tensors).

The EP all-to-all bytes of a real run follow its router's choices; the trace assumes balanced
routing. The measured iteration (the 2nd; the run is seeded, so its bytes are the same every
time) sends 1.7 % less than balanced (12.37 against 12.58 MB per rank); the 1st sends 7.9 % more
(13.57), the 3rd 2.3 % less (12.29), and benchmarks/README.md section 12's iterations 4-9 3.6 %
more (13.03): balanced routing is the centre, and a single iteration can miss it by more than
5 %. benchmarks/plan_vs_measured.py prints these tables, with the processes' RSS beside the
memory, and the time check.
"""

from __future__ import annotations

import pytest

from trinity_harness.jobs import COMMON as MULTINODE_JOB  # benchmarks/multinode.py's job
from trinity_harness.plan_runs import LAYOUTS, MEMORY_BATCH, measure_rank, trace_measured
from trinity_harness.ranks import run_ranks
from trinity_train.plan.collectives import (EP_ALL_TO_ALL, FSDP_ALL_GATHER, FSDP_EMBEDDING_ROWS_GATHER,
                                            FSDP_EMBEDDING_ROWS_REDUCE, FSDP_REDUCE_SCATTER, MUON_REDISTRIBUTE,
                                            sent_by_category)

TRAFFIC_MARGIN, MEMORY_MARGIN = 0.05, 0.10


def within(got: float, want: float, margin: float) -> bool:
    return abs(got - want) <= margin * want


@pytest.mark.slow  # two gloo ranks train the default model (~25 s) and two traces (~6 s)
def test_traced_bytes_per_collective_match_the_multinode_job(rank_pool, tmp_path):
    job = MULTINODE_JOB
    real = rank_pool(2).run(measure_rank, job, tmp_path / "run", False)
    for rank, measured in enumerate(real):
        traced = sent_by_category(trace_measured(job, tmp_path / "trace", 2, rank).collectives)
        assert {k for k, v in traced.items() if v} == {k for k, v in measured["traffic"].items() if v}
        for category in (FSDP_ALL_GATHER, FSDP_REDUCE_SCATTER, EP_ALL_TO_ALL, MUON_REDISTRIBUTE):
            assert within(traced[category], measured["traffic"][category], TRAFFIC_MARGIN), (
                f"rank {rank} {category}: traced {traced[category]:,.0f} B, measured "
                f"{measured['traffic'][category]:,.0f} B")
        # The embedding's rows read and touched depend on the tokens: the trace counts the whole table.
        for category in (FSDP_EMBEDDING_ROWS_GATHER, FSDP_EMBEDDING_ROWS_REDUCE):
            assert 0 < measured["traffic"][category] < traced[category] / 2, category


def assert_peak_matches(overrides: tuple[str, ...], measured: dict, world: int, rank: int, tmp_path) -> None:
    traced = trace_measured(overrides, tmp_path / "trace", world, rank)
    assert within(traced.peak, measured["tracked_peak"], MEMORY_MARGIN), (
        f"rank {rank}: traced {traced.memory}, measured {measured['tracked']}")


# A real step in a process of its own (~12-25 s each): both in the whole suite only.
@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["false", "true"])
def test_traced_peak_memory_of_one_process_matches_a_real_step(tmp_path, checkpointing):
    overrides = (*MEMORY_BATCH, f"--train.activation_checkpointing={checkpointing}")
    measured, = run_ranks(1, measure_rank, overrides, tmp_path / "run", True)  # one thread, as the ranks
    assert_peak_matches(overrides, measured, 1, 0, tmp_path)


@pytest.mark.slow  # gloo ranks train the default model twice per layout
@pytest.mark.parametrize("layout", [name for name, (world, _) in LAYOUTS.items() if world > 1])
def test_traced_peak_memory_of_every_rank_matches_a_real_step(rank_pool, tmp_path, layout):
    world, settings = LAYOUTS[layout]
    for checkpointing in ("false", "true"):
        overrides = (*MEMORY_BATCH, *settings, f"--train.activation_checkpointing={checkpointing}")
        real = rank_pool(world).run(measure_rank, overrides, tmp_path / f"run-{checkpointing}", True)
        for rank, measured in enumerate(real):
            assert_peak_matches(overrides, measured, world, rank, tmp_path)
