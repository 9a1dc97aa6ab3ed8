"""The parallel-layout matrix, trained once for every check that compares it.

`tests/test_parallel_equivalence.py` asserts on the losses, gradient norms, parameters, expert
biases and `"layers"` records of the same runs: each layout of conftest's TWO_RANK_LAYOUTS /
FOUR_RANK_LAYOUTS and a single-process reference per model (conftest's LAYOUT_REFERENCES), three
AdamW steps (`layout_config`) with layer statistics on every step. Training them once for all of it (they
were trained twice, in two files) halves the suite's largest cost. `recorded(trainer)` is what
every rank keeps of its run.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from helpers import assert_values_close
from trinity_train.callbacks import TrainerCallback
from trinity_train.files import read_jsonl
from trinity_train.train import Trainer

STEPS = 3
# Layer statistics on every step: the statistics tests compare each step's record.
COMMON = {"train": {"steps": STEPS}, "metrics": {"layer_stats_every": 1}}


def whole_params(model) -> dict[str, torch.Tensor]:
    """By model name (activation checkpointing's wrapper adds a level to module names)."""
    return {name.replace("_checkpoint_wrapped_module.", ""):
            (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def recorded(trainer: Trainer) -> dict:
    """Initial and final parameters (whole), expert biases, the losses / grad norms logged, and
    the `layer_stats` of every step as this rank computed them."""
    initial = whole_params(trainer.model)
    layer_stats = []

    class KeepLayerStats(TrainerCallback):
        def after_step(self, trainer, result, record):
            layer_stats.append(result.layer_stats)

    trainer.add_callback(KeepLayerStats())
    trainer.run()
    params = whole_params(trainer.model)
    if dist.is_initialized():
        dist.barrier()  # rank 0 has written metrics.jsonl
    records = [r for r in read_jsonl(trainer.run_dir / "metrics.jsonl") if r["kind"] == "train"]
    return {"initial": initial, "params": params,
            "biases": torch.stack([moe.expert_bias.clone() for moe in trainer.model.moe_layers]),
            "losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
            "layer_stats": layer_stats}


def assert_run_matches(ranks: list[dict], layout: str, reference: dict) -> None:
    """`layout`'s run (`recorded` on every rank) trained like the single process `reference`:
    bit-identical initial weights, losses and gradient norms within rel 1e-5, parameters within
    1e-4, expert biases identical on every rank and within 1e-7 of the reference's."""
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


# Layer statistics: relative tolerance on every float of the `"layers"` records.
TOLERANCE = 1e-5


def with_kurtosis(record: dict) -> dict:
    """The excess kurtosis as the kurtosis (+3): a relative tolerance on a value near 0 would ask
    for more digits than float32 activations carry."""
    return {**record, "act_kurtosis": [k + 3.0 for k in record["act_kurtosis"]]}


def assert_stats_match(ranks: list[dict], layout: str, reference: dict) -> None:
    """`layout`'s `"layers"` records equal the single process `reference`'s on every step, and
    every rank computed the same ones."""
    ours = ranks[0][layout]["layer_stats"]
    assert len(ours) == STEPS and all(r is not None for r in ours)
    for rank, results in enumerate(ranks[1:], start=1):
        assert results[layout]["layer_stats"] == ours, f"{layout}: rank {rank} computed another record"
    for step, (got, want) in enumerate(zip(ours, reference["layer_stats"]), start=1):
        for key in ("moe_layers", "tokens_per_expert", "experts_without_tokens"):
            assert got[key] == want[key], f"{layout} step {step}: {key}"
        assert_values_close(with_kurtosis(got), with_kurtosis(want), TOLERANCE, path=f"{layout} step {step}")
