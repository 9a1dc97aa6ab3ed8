"""Every parallel layout trains like one process does, through the real Trainer (the issue's
acceptance): three AdamW steps on the same global batches give the same losses and gradient norms
(rel <= 1e-5), the same parameters (<= 1e-4), the same, rank-identical expert biases, and the
same layer statistics. Each layout is trained once for all of these checks (`tests/layout_runs.py`).

Layouts (conftest.py): FSDP 2, TP 2, EP 2 on two gloo ranks, and FSDP 2 and HSDP 2 (two
micro-batches a rank) reducing their gradients per micro-batch and once a step; HSDP 2x2, TP 2 x
FSDP 2, EP 2 x FSDP 2 (ep taken from dp_shard=4), TP 2 x EP 2 (with activation checkpointing)
and EP 2 of six experts over dp_shard=4 (three local experts, which FSDP shards along dim 1) on
four; and TP 2 for
the block variants whose norms TP treats specially (NormFormer's width and head norms, Gemma 3's
(1 + g) norms). The global batch is 4 sequences everywhere (grad_accum makes up for fewer
data-parallel ranks), so every run reads exactly the same tokens. The sharded initialisation is
checked too: bit-identical to the single process's.

Layer statistics are global: under every layout the Trainer's `"layers"` records (on each of the
three steps) equal those of one process, and every rank computes the same record. Tolerance:
relative 1e-5 on every float. The first step starts from bit-identical weights, so only the
summation order differs (float32 noise, ~1e-7); the later ones start from weights AdamW steps apart
by about as much. Token counts per expert, experts without tokens and the MoE layer list are
compared exactly (the excess kurtosis as the kurtosis, since it lies near 0), and the ranks of one
run must agree bit for bit (every value comes out of the same all-reduces).
"""

from __future__ import annotations

import pytest

from conftest import (FOUR_RANK_LAYOUTS, LAYOUT_REFERENCES, TWO_RANK_LAYOUTS, layout_config, layout_reference,
                      merge_sections, run_layouts)
from layout_runs import COMMON, assert_run_matches, assert_stats_match, recorded
from trinity_train.train import Trainer

pytestmark = pytest.mark.slow  # every layout on 2 and 4 gloo ranks: the suite's largest fixture


@pytest.fixture(scope="module")
def layout_runs(corpus, tmp_path_factory, rank_pool) -> dict:
    """Every layout of the matrix and its single-process references, trained once
    (`tests/layout_runs.py`): {"references": {name: run}, 2: [rank results], 4: [...]}, each rank's
    result being {layout: run}."""
    root = tmp_path_factory.mktemp("layouts")
    references = {name: recorded(Trainer(layout_config(corpus, root / name,
                                                       merge_sections(COMMON, {"model": model}), 1)))
                  for name, model in LAYOUT_REFERENCES.items()}
    return {"references": references,
            2: rank_pool(2).run(run_layouts, corpus, root / "two", TWO_RANK_LAYOUTS, recorded, COMMON),
            4: rank_pool(4).run(run_layouts, corpus, root / "four", FOUR_RANK_LAYOUTS, recorded, COMMON)}


def assert_matches_reference(ranks: list[dict], layout: str, references: dict) -> None:
    assert_run_matches(ranks, layout, references[layout_reference(layout)])


@pytest.mark.parametrize("name", list(LAYOUT_REFERENCES))
def test_reference_run_learns_and_balances(layout_runs, name):
    reference = layout_runs["references"][name]
    assert reference["losses"][-1] < reference["losses"][0]
    assert reference["biases"].abs().sum() > 0, "expert biases never moved"


@pytest.mark.parametrize("layout", list(TWO_RANK_LAYOUTS))
def test_two_rank_layout_matches_one_process(layout_runs, layout):
    assert_matches_reference(layout_runs[2], layout, layout_runs["references"])


@pytest.mark.parametrize("layout", list(FOUR_RANK_LAYOUTS))
def test_four_rank_layout_matches_one_process(layout_runs, layout):
    assert_matches_reference(layout_runs[4], layout, layout_runs["references"])


# ---------------------------------------------------------------------------- layer statistics

def assert_like_one_process(ranks: list[dict], layout: str, references: dict) -> None:
    assert_stats_match(ranks, layout, references[layout_reference(layout)])


def test_reference_records_are_complete(layout_runs):
    for name, run in layout_runs["references"].items():
        first = run["layer_stats"][0]
        assert None not in first["attn_post_rms"]  # every block of LAYOUT_REFERENCES has one
        assert (None in first["ffn_post_rms"]) == (name == "normformer")
        assert all(v > 0 for v in first["grad_norm_attn"] + first["grad_norm_ffn"] + first["residual_rms"])
        assert sum(map(sum, first["tokens_per_expert"])) > 0


@pytest.mark.parametrize("layout", [*TWO_RANK_LAYOUTS, *FOUR_RANK_LAYOUTS])
def test_layout_gives_the_single_process_statistics(layout_runs, layout):
    world = 2 if layout in TWO_RANK_LAYOUTS else 4
    assert_like_one_process(layout_runs[world], layout, layout_runs["references"])
