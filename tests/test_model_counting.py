"""Parameter and FLOP counting from the config, checked against built models and a FLOP counter."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from conftest import tiny_model
from trinity_train.config import ModelConfig, load_config
from trinity_train.model import build_model
from trinity_train.model.counting import (attended_keys_per_query, count_parameters,
                                          training_flops_per_token)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def tiny(**overrides) -> ModelConfig:
    return tiny_model(**{"num_layers": 5, "num_dense_layers": 2, **overrides})


def counted_from(model) -> tuple[int, int]:
    """(total, active) read off a built model: active drops the routed experts a token skips."""
    total = sum(p.numel() for p in model.parameters())
    cfg = model.cfg
    skipped = sum(moe.experts.gate_proj[0].numel() * 3 * (cfg.num_experts - cfg.num_experts_per_tok)
                  for moe in model.moe_layers)
    return total, total - skipped


@pytest.mark.parametrize("block", ["trinity", "sandwich", "prenorm", "gemma3", "normformer"])
@pytest.mark.parametrize("shared", [0, 2])
def test_counts_match_a_meta_build_of_every_variant(block, shared):
    cfg = tiny(block=block, num_shared_experts=shared)
    counts = count_parameters(cfg)
    model = build_model(cfg, device="meta")
    assert (counts.total, counts.active) == counted_from(model)
    assert counts.vectors == sum(p.numel() for p in model.parameters() if p.ndim == 1)


@pytest.mark.parametrize("name, total, active", [
    ("nano", 6.1e9, 1.0e9),
    ("mini", 26e9, 3.5e9),
    ("large", 400e9, 13e9),
])
def test_released_configs_build_on_meta_with_published_sizes(name, total, active):
    cfg = load_config(CONFIGS / f"{name}.toml").model
    counts = count_parameters(cfg)
    assert (counts.total, counts.active) == counted_from(build_model(cfg, device="meta"))
    assert counts.total == pytest.approx(total, rel=0.03)
    assert counts.active == pytest.approx(active, rel=0.05)


def test_matmul_flops_are_six_per_active_matrix_parameter_per_token():
    cfg = tiny(expert_impl="loop")  # the loop's F.linear calls are visible to the FLOP counter
    model = build_model(cfg)
    ids = torch.randint(0, 64, (2, 9))
    with FlopCounterMode(display=False) as counter:
        logits = model(ids).logits
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    # Parameter matmuls only: attention is checked below, and the MoE combine (a batched product
    # summing each token's k weighted expert outputs: k MACs per output element) is no more a
    # model FLOP than the elementwise work is.
    measured = sum(v for op, v in counter.get_flop_counts()["Global"].items()
                   if "attention" not in str(op) and "bmm" not in str(op))
    attention = sum(12 * cfg.num_heads * cfg.head_dim * attended_keys_per_query(cfg, i, 9)
                    for i in range(cfg.num_layers))
    per_token = training_flops_per_token(cfg, seq_len=9) - attention
    assert measured == pytest.approx(per_token * ids.numel(), rel=1e-9)


def test_attention_flops_count_only_attended_keys():
    cfg = tiny(num_layers=4, sliding_window=4)  # layers 0-2 local, layer 3 global
    assert attended_keys_per_query(cfg, 3, 10) == 5.5  # (T + 1) / 2
    assert attended_keys_per_query(cfg, 0, 10) == (1 + 2 + 3 + 4 * 7) / 10
    longer = training_flops_per_token(cfg, 20) - training_flops_per_token(cfg, 10)
    expected = 12 * 4 * 8 * (3 * (attended_keys_per_query(cfg, 0, 20) - 3.4) + (10.5 - 5.5))
    assert longer == pytest.approx(expected)
