"""Layer statistics are global: under FSDP, TP, EP, HSDP and their combinations on gloo ranks the
Trainer's `"layers"` records equal those of one process on the same global batches, and every
rank computes the same record.

The layouts are those of test_parallel_equivalence (conftest.py; the global batch is 4 sequences
everywhere), two steps with statistics on both. Tolerance: relative 1e-5 on every float. The first
step starts from bit-identical weights, so only the summation order differs (float32 noise,
~1e-7); the second starts from weights one AdamW step apart by about as much. Token counts per
expert, experts without tokens and the MoE layer list are compared exactly (the excess kurtosis as
the kurtosis, since it lies near 0), and the ranks of one run must agree bit for bit (every value
comes out of the same all-reduces).
"""

from __future__ import annotations

import pytest

from conftest import (FOUR_RANK_LAYOUTS, LAYOUT_BLOCKS, TWO_RANK_LAYOUTS, layout_block, layout_config,
                      merge_sections, run_layouts)
from helpers import assert_values_close
from ranks import run_ranks
from trinity_train.train import Trainer

TOLERANCE = 1e-5
STATS = {"train": {"steps": 2}, "metrics": {"layer_stats_every": 1}}


def layer_records(trainer: Trainer) -> list[dict]:
    """The `layer_stats` of every step this rank's trainer ran."""
    step, records = trainer.step_fn, []

    def recording_step(*args):
        result = step(*args)
        records.append(result.layer_stats)
        return result

    trainer.step_fn = recording_step
    trainer.run()
    return records


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory) -> dict[str, list[dict]]:
    """One process, per block variant."""
    return {block: layer_records(Trainer(layout_config(corpus, tmp_path_factory.mktemp(block),
                                                       merge_sections(STATS, {"model": {"block": block}}), 1)))
            for block in LAYOUT_BLOCKS}


@pytest.fixture(scope="module")
def two_rank_records(corpus, tmp_path_factory) -> list[dict]:
    return run_ranks(2, run_layouts, corpus, tmp_path_factory.mktemp("two"), TWO_RANK_LAYOUTS,
                     layer_records, STATS)


@pytest.fixture(scope="module")
def four_rank_records(corpus, tmp_path_factory) -> list[dict]:
    return run_ranks(4, run_layouts, corpus, tmp_path_factory.mktemp("four"), FOUR_RANK_LAYOUTS,
                     layer_records, STATS)


def with_kurtosis(record: dict) -> dict:
    """The excess kurtosis as the kurtosis (+3): a relative tolerance on a value near 0 would ask
    for more digits than float32 activations carry."""
    return {**record, "act_kurtosis": [k + 3.0 for k in record["act_kurtosis"]]}


def assert_like_one_process(ranks: list[dict], layout: str, references: dict) -> None:
    ours = ranks[0][layout]
    assert len(ours) == 2 and all(r is not None for r in ours)
    for rank, results in enumerate(ranks[1:], start=1):
        assert results[layout] == ours, f"{layout}: rank {rank} computed another record"
    for step, (got, want) in enumerate(zip(ours, references[layout_block(layout)]), start=1):
        for key in ("moe_layers", "tokens_per_expert", "experts_without_tokens"):
            assert got[key] == want[key], f"{layout} step {step}: {key}"
        assert_values_close(with_kurtosis(got), with_kurtosis(want), TOLERANCE, path=f"{layout} step {step}")


def test_reference_records_are_complete(references):
    for block, records in references.items():
        first = records[0]
        assert None not in first["attn_post_rms"]  # every block of LAYOUT_BLOCKS has one
        assert (None in first["ffn_post_rms"]) == (block == "normformer")
        assert all(v > 0 for v in first["grad_norm_attn"] + first["grad_norm_ffn"] + first["residual_rms"])
        assert sum(map(sum, first["tokens_per_expert"])) > 0


@pytest.mark.parametrize("layout", [*TWO_RANK_LAYOUTS, *FOUR_RANK_LAYOUTS])
def test_layout_gives_the_single_process_statistics(request, references, layout):
    ranks = request.getfixturevalue("two_rank_records" if layout in TWO_RANK_LAYOUTS else "four_rank_records")
    assert_like_one_process(ranks, layout, references)
