"""Every parallel layout trains like one process does, through the real Trainer (the issue's
acceptance): three AdamW steps on the same global batches give the same losses and gradient norms
(rel <= 1e-5), the same parameters (<= 1e-4) and the same, rank-identical expert biases.

Layouts: FSDP 2, TP 2, EP 2 on two gloo ranks; HSDP 2x2, TP 2 x FSDP 2, EP 2 x FSDP 2 (ep taken
from dp_shard=4) and TP 2 x EP 2 on four. The global batch is 4 sequences everywhere (grad_accum
makes up for fewer data-parallel ranks), so every run reads exactly the same tokens.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trinity_train.config import load_config
from trinity_train.data.prepare import PrepareOptions, prepare
from trinity_train.observe.jsonl import read_jsonl
from trinity_train.parallel.local_ranks import init_gloo, run_ranks
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.train import Trainer, build_model_for_training, distributed_placement

GLOBAL_ROWS = 4
TWO_RANKS = {"fsdp2": {"dp_shard": 2}, "tp2": {"tp": 2}, "ep2": {"ep": 2}}
FOUR_RANKS = {"hsdp2x2": {"dp_replicate": 2, "dp_shard": 2}, "tp2_fsdp2": {"tp": 2},
              "ep2_fsdp2": {"ep": 2}, "tp2_ep2": {"tp": 2, "ep": 2}}
WORDS = "red green blue cyan magenta yellow black white grey pink brown olive navy teal".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel_corpus")
    rng = random.Random(1)
    (root / "docs").mkdir()
    for i in range(30):
        (root / "docs" / f"d{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(300)))
    return prepare(PrepareOptions(inputs=[str(root / "docs")], out=str(root / "prepared"),
                                  train_tokenizer=300, val_fraction=0.1, progress=False))


def layout_config(corpus, run_dir, parallel: dict, world: int):
    dp = world // parallel.get("tp", 1)
    return load_config(None, {
        "model": {"vocab_size": 320, "hidden_size": 32, "num_layers": 3, "num_dense_layers": 1,
                  "num_heads": 2, "num_kv_heads": 2, "head_dim": 16, "intermediate_size": 64,
                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                  "route_scale": 2.0, "sliding_window": 8, "global_every": 2,
                  "bias_update_rate": 1e-2},
        "data": {"path": str(corpus), "seq_len": 16},
        "train": {"steps": 3, "micro_batch_size": 1, "grad_accum": GLOBAL_ROWS // dp,
                  "eval_every": 0, "grad_clip": 0.5, "seed": 5},
        # Adam's eps is raised from 1e-8: near-zero gradients (sums that cancel to ~1e-6) differ
        # in their last bits between summation orders, and a tiny eps turns that noise into whole
        # lr-sized steps of either sign. 1e-4 keeps real gradients at full Adam steps.
        "optim": {"name": "adamw", "lr": 1e-2, "eps": 1e-4, "schedule": "constant",
                  "warmup_steps": 0},
        "checkpoint": {"every": 0},
        "metrics": {"progress_bar": False, "peak_flops": 1e11},
        "run": {"dir": str(run_dir)},
        "parallel": parallel,
    })


def finished_state(trainer: Trainer) -> dict:
    """Parameters (whole), expert biases, and the losses/grad norms rank 0 logged."""
    params = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for name, p in trainer.model.named_parameters()}
    if dist.is_initialized():
        dist.barrier()  # rank 0 has written metrics.jsonl
    records = [r for r in read_jsonl(trainer.run_dir / "metrics.jsonl") if r["kind"] == "train"]
    return {"params": params,
            "biases": torch.stack([moe.expert_bias.clone() for moe in trainer.model.moe_layers]),
            "losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records]}


def train_layouts(corpus, root, layouts: dict) -> dict:
    init_gloo()
    world = dist.get_world_size()
    results = {}
    for name, parallel in layouts.items():
        cfg = layout_config(corpus, root / name, parallel, world)
        dims = ParallelDims.from_config(cfg, world)
        dims.build_mesh("cpu")
        trainer = Trainer(cfg, distributed_placement(dims, torch.device("cpu")),
                          model_builder=functools.partial(build_model_for_training, dims=dims))
        trainer.run()
        results[name] = finished_state(trainer)
    return results


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> dict:
    trainer = Trainer(layout_config(corpus, tmp_path_factory.mktemp("one_process"), {}, 1))
    trainer.run()
    return finished_state(trainer)


@pytest.fixture(scope="module")
def two_rank_results(corpus, tmp_path_factory) -> list[dict]:
    return run_ranks(2, train_layouts, corpus, tmp_path_factory.mktemp("two"), TWO_RANKS)


@pytest.fixture(scope="module")
def four_rank_results(corpus, tmp_path_factory) -> list[dict]:
    return run_ranks(4, train_layouts, corpus, tmp_path_factory.mktemp("four"), FOUR_RANKS)


def assert_matches_reference(ranks: list[dict], layout: str, reference: dict) -> None:
    ours = ranks[0][layout]
    assert len(ours["losses"]) == 3
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


def test_reference_run_learns_and_balances(reference):
    assert reference["losses"][-1] < reference["losses"][0]
    assert reference["biases"].abs().sum() > 0, "expert biases never moved"


@pytest.mark.parametrize("layout", list(TWO_RANKS))
def test_two_rank_layout_matches_one_process(two_rank_results, reference, layout):
    assert_matches_reference(two_rank_results, layout, reference)


@pytest.mark.parametrize("layout", list(FOUR_RANKS))
def test_four_rank_layout_matches_one_process(four_rank_results, reference, layout):
    assert_matches_reference(four_rank_results, layout, reference)
