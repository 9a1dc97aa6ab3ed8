"""Every parallel layout trains the debug model like one process does (DESIGN §4, the issue's
acceptance): three AdamW steps on the same global batches give the same losses (rel <= 1e-5), the
same parameters (<= 1e-4) and the same, rank-identical expert biases.

The step here is spelled out (forward, token-weighted loss over the global batch, backward, global
clipping, AdamW, expert-bias update from all-reduced counts) with the helpers `parallel/` gives
the trainer; ranks are gloo processes on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from trinity_train.parallel.local_ranks import init_gloo, run_ranks
from trinity_train.config import load_config
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.parallelize import build_parallel_model
from trinity_train.parallel.reductions import clip_grad_norm_, sum_over_data_parallel

STEPS = 3
GLOBAL_ROWS = 4

TWO_RANKS = {"fsdp2": {"dp_shard": 2}, "tp2": {"tp": 2}, "ep2": {"ep": 2}}
FOUR_RANKS = {"hsdp2x2": {"dp_replicate": 2, "dp_shard": 2}, "tp2_fsdp2": {"tp": 2},
              "ep2_fsdp2": {"ep": 2}, "tp2_ep2": {"tp": 2, "ep": 2}}


def tiny_config(parallel: dict | None = None):
    overrides = {
        "model": {"vocab_size": 256, "hidden_size": 64, "num_layers": 3, "num_dense_layers": 1,
                  "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "intermediate_size": 128,
                  "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "route_scale": 2.0, "sliding_window": 16, "global_every": 2,
                  "bias_update_rate": 0.01},
        "data": {"seq_len": 32},
        "train": {"seed": 3, "grad_clip": 0.5},
        "parallel": parallel or {},
    }
    return load_config(Path(__file__).parents[1] / "configs" / "debug.toml", overrides)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counting sequences (learnable within a few steps) from a random start per row."""
    g = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, 256, (GLOBAL_ROWS, 1), generator=g)
    tokens = (starts + torch.arange(33)) % 256
    labels = tokens[:, 1:].clone()
    labels[0, :5] = -100  # uneven token counts across ranks
    return tokens[:, :-1], labels


def train(cfg, dims: ParallelDims) -> dict:
    """Three optimizer steps; returns losses, full parameters and expert biases."""
    device = torch.device("cpu")
    model = build_parallel_model(cfg, dims, device)
    # Adam's eps is raised from 1e-8: near-zero gradients (sums that cancel to ~1e-6) differ in
    # their last bits between summation orders, and with a tiny eps Adam turns that noise into
    # whole lr-sized steps of opposite sign. 1e-4 keeps real gradients at full Adam steps.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-4,
                                  weight_decay=0.1)
    rows = GLOBAL_ROWS // dims.dp
    lo = dims.dp_rank * rows
    losses, norms = [], []
    for step in range(STEPS):
        tokens, labels = global_batch(step)
        tokens, labels = tokens[lo:lo + rows], labels[lo:lo + rows]
        global_tokens = sum_over_data_parallel((labels != -100).sum(), dims)
        out = model(tokens, labels=labels)
        (out.ce_sum / global_tokens).backward()
        norms.append(clip_grad_norm_(model.parameters(), cfg.train.grad_clip).item())
        optimizer.step()
        optimizer.zero_grad()
        model.update_expert_biases(sum_over_data_parallel(out.tokens_per_expert, dims))
        losses.append((sum_over_data_parallel(out.ce_sum.detach(), dims) / global_tokens).item())
    params = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for name, p in model.named_parameters()}
    biases = torch.stack([moe.expert_bias.clone() for moe in model.moe_layers])
    return {"losses": losses, "norms": norms, "params": params, "biases": biases}


def _run_layouts(layouts: dict, world: int) -> dict:
    init_gloo()
    results = {}
    for name, parallel in layouts.items():
        cfg = tiny_config(parallel)
        dims = ParallelDims.from_config(cfg, world)
        dims.build_mesh("cpu")
        results[name] = train(cfg, dims)
    return results


@pytest.fixture(scope="module")
def reference() -> dict:
    cfg = tiny_config()
    return train(cfg, ParallelDims.from_config(cfg, 1))


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict]:
    return run_ranks(2, _run_layouts, TWO_RANKS, 2)


@pytest.fixture(scope="module")
def four_rank_results() -> list[dict]:
    return run_ranks(4, _run_layouts, FOUR_RANKS, 4)


def assert_matches_reference(ranks: list[dict], layout: str, reference: dict) -> None:
    for rank, results in enumerate(ranks):
        res = results[layout]
        for step, (got, want) in enumerate(zip(res["losses"], reference["losses"])):
            assert abs(got - want) <= 1e-5 * abs(want), (
                f"{layout} rank {rank} step {step}: loss {got} vs single process {want}")
        assert res["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        assert torch.equal(res["biases"], ranks[0][layout]["biases"]), "expert_bias differs by rank"
        assert torch.allclose(res["biases"], reference["biases"], atol=1e-7), "expert_bias differs"
    params = ranks[0][layout]["params"]
    assert params.keys() == reference["params"].keys()
    for name, want in reference["params"].items():
        err = (params[name] - want).abs().max().item()
        assert err <= 1e-4, f"{layout}: {name} differs from the single process by {err}"


def test_reference_run_trains(reference):
    assert reference["losses"][-1] < reference["losses"][0]
    assert reference["biases"].abs().sum() > 0, "expert biases never moved"


@pytest.mark.parametrize("layout", list(TWO_RANKS))
def test_two_rank_layout_matches_one_process(two_rank_results, reference, layout):
    assert_matches_reference(two_rank_results, layout, reference)


@pytest.mark.parametrize("layout", list(FOUR_RANKS))
def test_four_rank_layout_matches_one_process(four_rank_results, reference, layout):
    assert_matches_reference(four_rank_results, layout, reference)
