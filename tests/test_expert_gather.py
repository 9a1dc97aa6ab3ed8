"""Experts gathered once a step (`parallel.expert_gather = "step"`, parallel/fsdp.py) train like
one process, as every layout does (tests/test_parallel_equivalence.py): EP 2 x FSDP 2 (experts
sharded over efsdp = 2) and HSDP 2 x 2 (no EP: the experts their own unit over the shard group),
each with four micro-batches a rank, so that the experts stay gathered, and their gradients summed
unsharded, through three micro-batches before the last one reduces them. The reference reads the
same 16-row global batches in one process (16 micro-batches)."""

from __future__ import annotations

import pytest

from conftest import layout_config, merge_sections, run_layouts
from layout_runs import COMMON, assert_run_matches, assert_stats_match, recorded
from trinity_train.train import Trainer

pytestmark = pytest.mark.slow  # four gloo ranks, two layouts and a reference: ~1 min

ROWS = 16  # the global batch: four micro-batches of one row on each of four data-parallel ranks
LAYOUTS = {
    "ep2_fsdp2_experts_once": {"parallel": {"ep": 2, "expert_gather": "step"}, "train": {"grad_accum": ROWS // 4}},
    "hsdp2x2_experts_once": {"parallel": {"dp_replicate": 2, "dp_shard": 2, "expert_gather": "step"},
                             "train": {"grad_accum": ROWS // 4}},
}


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory, rank_pool) -> dict:
    root = tmp_path_factory.mktemp("experts_once")
    reference = recorded(Trainer(layout_config(corpus, root / "reference",
                                               merge_sections(COMMON, {"train": {"grad_accum": ROWS}}), 1)))
    return {"reference": reference, "ranks": rank_pool(4).run(run_layouts, corpus, root / "four", LAYOUTS,
                                                              recorded, COMMON)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_experts_gathered_once_a_step_train_like_one_process(runs, layout):
    assert_run_matches(runs["ranks"], layout, runs["reference"])
    assert_stats_match(runs["ranks"], layout, runs["reference"])
