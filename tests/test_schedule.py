"""Learning-rate schedules (WSD, cosine, linear, constant; their tops and floors) and the AdamW parameter groups."""

import math

import pytest
import torch
from torch import nn

from trinity_train.config import Config, OptimConfig
from trinity_train.optim.groups import build_optimizer
from trinity_train.optim.schedule import build_scheduler, lr_multiplier


def multipliers(total, **optim):
    cfg = OptimConfig(**optim)
    return [lr_multiplier(s, cfg, total) for s in range(total)]


def test_wsd_warms_up_holds_then_decays_linearly():
    m = multipliers(10, schedule="wsd", warmup_steps=2, decay_fraction=0.4, min_lr_ratio=0.0)
    assert m == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25])


def test_wsd_decays_towards_the_floor():
    m = multipliers(4, schedule="wsd", warmup_steps=0, decay_fraction=0.5, min_lr_ratio=0.2)
    assert m == pytest.approx([1.0, 1.0, 1.0, 0.6])


def test_cosine_runs_from_peak_to_floor_after_warmup():
    m = multipliers(12, schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    assert m[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert m[7] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(a > b for a, b in zip(m[2:], m[3:]))
    assert lr_multiplier(12, OptimConfig(schedule="cosine", warmup_steps=2, min_lr_ratio=0.1), 12) == pytest.approx(0.1)


def test_linear_warms_up_to_the_top_then_decays_linearly_to_the_floor():
    # Trinity Nano and Mini's context extension: re-warm linearly to 1/10 of the peak, then decay to 0.
    m = multipliers(10, schedule="linear", warmup_steps=2, peak_lr_ratio=0.1, min_lr_ratio=0.0)
    assert m == pytest.approx([0.05, 0.1, 0.1, 0.0875, 0.075, 0.0625, 0.05, 0.0375, 0.025, 0.0125])
    assert lr_multiplier(10, OptimConfig(schedule="linear", warmup_steps=2, peak_lr_ratio=0.1), 10) == 0.0


def test_cosine_continues_between_two_fractions_of_the_peak():
    # Trinity Large's context extension: the cosine continues from 1/10 to 1/20 of the peak, no warmup.
    m = multipliers(5, schedule="cosine", warmup_steps=0, peak_lr_ratio=0.1, min_lr_ratio=0.05)
    assert m == pytest.approx([0.1, 0.05 + 0.05 * 0.5 * (1 + math.cos(math.pi * 0.2)),
                               0.05 + 0.05 * 0.5 * (1 + math.cos(math.pi * 0.4)),
                               0.05 + 0.05 * 0.5 * (1 + math.cos(math.pi * 0.6)),
                               0.05 + 0.05 * 0.5 * (1 + math.cos(math.pi * 0.8))])
    assert lr_multiplier(5, OptimConfig(schedule="cosine", warmup_steps=0, peak_lr_ratio=0.1,
                                        min_lr_ratio=0.05), 5) == pytest.approx(0.05)


def test_every_schedule_tops_out_at_the_peak_ratio():
    for schedule in ("wsd", "cosine", "linear", "constant"):
        full = multipliers(20, schedule=schedule, warmup_steps=4, min_lr_ratio=0.0)
        part = multipliers(20, schedule=schedule, warmup_steps=4, min_lr_ratio=0.0, peak_lr_ratio=0.25)
        assert max(part) == pytest.approx(0.25), schedule
        assert part == pytest.approx([0.25 * f for f in full]), schedule


def test_constant_only_warms_up():
    assert multipliers(5, schedule="constant", warmup_steps=4) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


def test_scheduler_scales_each_group_from_its_own_peak_and_survives_state_dict():
    cfg = Config()
    cfg.train.steps = 10
    cfg.optim.warmup_steps = 4
    model = nn.Linear(3, 3)
    opt = torch.optim.AdamW([{"params": [model.weight], "lr": 1.0}, {"params": [model.bias], "lr": 0.1}])
    sched = build_scheduler(opt, cfg)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.25, 0.025])
    for _ in range(2):
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.75, 0.075])

    opt2 = torch.optim.AdamW([{"params": [model.weight], "lr": 1.0}, {"params": [model.bias], "lr": 0.1}])
    sched2 = build_scheduler(opt2, cfg)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    opt.step(), sched.step(), opt2.step(), sched2.step()
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4, bias=True)
        self.norm = nn.LayerNorm(4)
        self.experts = nn.Parameter(torch.zeros(2, 4, 4))
        self.head_scale = nn.Parameter(torch.ones(2))
        self.lm_head = nn.Linear(4, 10, bias=False)
        self.frozen = nn.Parameter(torch.zeros(3, 3), requires_grad=False)


def test_weight_decay_only_on_hidden_matrices():
    model = Tiny()
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1, lr=1e-3))
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["name"]: ({names[id(p)] for p in g["params"]}, g) for g in opt.param_groups}
    decayed, group = groups["adamw_decay"]
    assert decayed == {"proj.weight", "experts", "lm_head.weight"} and group["weight_decay"] == 0.1
    not_decayed, group = groups["adamw_no_decay"]
    assert not_decayed == {"embed.weight", "proj.bias", "norm.weight", "norm.bias", "head_scale"}
    assert group["weight_decay"] == 0.0
    assert all(g["kind"] == "adamw" and g["lr"] == 1e-3 for g in opt.param_groups)
    assert opt.defaults["fused"]  # one kernel instead of a per-tensor loop

