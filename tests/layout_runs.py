"""The parallel-layout matrix, trained once for every check that compares it.

`tests/test_parallel_equivalence.py` asserts on the losses, gradient norms, parameters, expert
biases and `"layers"` records of the same runs: each layout of conftest's TWO_RANK_LAYOUTS /
FOUR_RANK_LAYOUTS and a single-process reference per model (conftest's LAYOUT_REFERENCES), three
AdamW steps (`layout_config`) with layer statistics on every step. Training them once for all of it (they
were trained twice, in two files) halves the suite's largest cost. `recorded(trainer)` is what
every rank keeps of its run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

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
