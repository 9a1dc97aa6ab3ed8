"""Expert-load statistics match their definitions."""

import pytest
import torch

from trinity_train.observe import expert_load_stats


def test_load_stats_per_layer_and_summary():
    counts = torch.tensor([[10.0, 10.0, 10.0, 10.0],   # perfectly balanced
                           [40.0, 0.0, 0.0, 0.0]])     # one expert takes everything
    stats = expert_load_stats(counts)
    assert stats["moe_max_load_per_layer"] == pytest.approx([1.0, 4.0])
    assert stats["moe_min_load_per_layer"] == pytest.approx([1.0, 0.0])
    assert stats["moe_cv_per_layer"] == pytest.approx([0.0, 3 ** 0.5])  # std 17.32 / mean 10
    assert stats["moe_max_load"] == pytest.approx(4.0) and stats["moe_min_load"] == 0.0
    assert stats["moe_cv"] == pytest.approx(3 ** 0.5 / 2)


def test_no_moe_layers_no_stats():
    assert expert_load_stats(torch.zeros(0, 8)) == {}
