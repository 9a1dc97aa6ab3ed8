"""Every parallel layout trains like one process does, through the real Trainer (the issue's
acceptance): three AdamW steps (trained once per session for this file and the layer-statistics
tests: `tests/layout_runs.py`) on the same global batches give the same losses and gradient norms
(rel <= 1e-5), the same parameters (<= 1e-4) and the same, rank-identical expert biases.

Layouts (conftest.py): FSDP 2, TP 2, EP 2 on two gloo ranks; HSDP 2x2, TP 2 x FSDP 2, EP 2 x FSDP 2
(ep taken from dp_shard=4) and TP 2 x EP 2 (with activation checkpointing) on four; and TP 2 for
the block variants whose norms TP treats specially (NormFormer's width and head norms, Gemma 3's
(1 + g) norms). The global batch is 4 sequences everywhere (grad_accum makes up for fewer
data-parallel ranks), so every run reads exactly the same tokens. The sharded initialisation is checked too:
bit-identical to the single process's.
"""

from __future__ import annotations

import pytest
import torch

from conftest import FOUR_RANK_LAYOUTS, LAYOUT_BLOCKS, TWO_RANK_LAYOUTS, layout_block
from layout_runs import STEPS


def assert_matches_reference(ranks: list[dict], layout: str, references: dict) -> None:
    reference = references[layout_block(layout)]
    ours = ranks[0][layout]
    for name, want in reference["initial"].items():
        assert torch.equal(ours["initial"][name], want), f"{layout}: {name} starts differently"
    assert len(ours["losses"]) == STEPS
    for step, (got, want) in enumerate(zip(ours["losses"], reference["losses"])):
        assert abs(got - want) <= 1e-5 * abs(want), f"{layout} step {step}: loss {got} vs {want}"
    assert ours["norms"] == pytest.approx(reference["norms"], rel=1e-5)
    for rank, results in enumerate(ranks):
        biases = results[layout]["biases"]
        assert torch.equal(biases, ours["biases"]), f"{layout}: expert_bias of rank {rank} differs"
    assert torch.allclose(ours["biases"], reference["biases"], rtol=0, atol=1e-7)
    assert ours["params"].keys() == reference["params"].keys()
    for name, want in reference["params"].items():
        err = (ours["params"][name] - want).abs().max().item()
        assert err <= 1e-4, f"{layout}: {name} differs from the single process by {err}"


@pytest.mark.parametrize("block", LAYOUT_BLOCKS)
def test_reference_run_learns_and_balances(layout_runs, block):
    reference = layout_runs["references"][block]
    assert reference["losses"][-1] < reference["losses"][0]
    assert reference["biases"].abs().sum() > 0, "expert biases never moved"


@pytest.mark.parametrize("layout", list(TWO_RANK_LAYOUTS))
def test_two_rank_layout_matches_one_process(layout_runs, layout):
    assert_matches_reference(layout_runs[2], layout, layout_runs["references"])


@pytest.mark.parametrize("layout", list(FOUR_RANK_LAYOUTS))
def test_four_rank_layout_matches_one_process(layout_runs, layout):
    assert_matches_reference(layout_runs[4], layout, layout_runs["references"])
