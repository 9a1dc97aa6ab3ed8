"""Layer statistics are global: under FSDP, TP, EP, HSDP and their combinations on gloo ranks the
Trainer's `"layers"` records equal those of one process on the same global batches, and every
rank computes the same record.

The layouts are those of test_parallel_equivalence, trained once for both files
(`tests/layout_runs.py`; the global batch is 4 sequences everywhere), three steps with statistics
on each. Tolerance: relative 1e-5 on every float. The first
step starts from bit-identical weights, so only the summation order differs (float32 noise,
~1e-7); the later ones start from weights AdamW steps apart by about as much. Token counts per
expert, experts without tokens and the MoE layer list are compared exactly (the excess kurtosis as
the kurtosis, since it lies near 0), and the ranks of one run must agree bit for bit (every value
comes out of the same all-reduces).
"""

from __future__ import annotations

import pytest

from conftest import FOUR_RANK_LAYOUTS, TWO_RANK_LAYOUTS, layout_block
from helpers import assert_values_close
from layout_runs import STEPS

TOLERANCE = 1e-5


def with_kurtosis(record: dict) -> dict:
    """The excess kurtosis as the kurtosis (+3): a relative tolerance on a value near 0 would ask
    for more digits than float32 activations carry."""
    return {**record, "act_kurtosis": [k + 3.0 for k in record["act_kurtosis"]]}


def assert_like_one_process(ranks: list[dict], layout: str, references: dict) -> None:
    ours = ranks[0][layout]["layer_stats"]
    assert len(ours) == STEPS and all(r is not None for r in ours)
    for rank, results in enumerate(ranks[1:], start=1):
        assert results[layout]["layer_stats"] == ours, f"{layout}: rank {rank} computed another record"
    want_records = references[layout_block(layout)]["layer_stats"]
    for step, (got, want) in enumerate(zip(ours, want_records), start=1):
        for key in ("moe_layers", "tokens_per_expert", "experts_without_tokens"):
            assert got[key] == want[key], f"{layout} step {step}: {key}"
        assert_values_close(with_kurtosis(got), with_kurtosis(want), TOLERANCE, path=f"{layout} step {step}")


def test_reference_records_are_complete(layout_runs):
    for block, run in layout_runs["references"].items():
        first = run["layer_stats"][0]
        assert None not in first["attn_post_rms"]  # every block of LAYOUT_BLOCKS has one
        assert (None in first["ffn_post_rms"]) == (block == "normformer")
        assert all(v > 0 for v in first["grad_norm_attn"] + first["grad_norm_ffn"] + first["residual_rms"])
        assert sum(map(sum, first["tokens_per_expert"])) > 0


@pytest.mark.parametrize("layout", [*TWO_RANK_LAYOUTS, *FOUR_RANK_LAYOUTS])
def test_layout_gives_the_single_process_statistics(layout_runs, layout):
    world = 2 if layout in TWO_RANK_LAYOUTS else 4
    assert_like_one_process(layout_runs[world], layout, layout_runs["references"])
