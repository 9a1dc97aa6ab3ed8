"""Which parameters Muon gets, at which learning rate, under one schedule."""

import pytest
import torch

from trinity_train.config import load_config
from trinity_train.model import build_model
from trinity_train.optim.groups import build_optimizer, is_muon_param
from trinity_train.optim.muon import Muon
from trinity_train.optim.schedule import build_scheduler

TINY_MODEL = {"vocab_size": 64, "hidden_size": 16, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
              "head_dim": 8, "intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 8, "sliding_window": 8}

MUON_SUFFIXES = ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight",
                 "attn.gate_proj.weight", "attn.o_proj.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight", "shared_expert.gate_proj.weight",
                 "shared_expert.up_proj.weight", "shared_expert.down_proj.weight", "experts.gate_proj",
                 "experts.up_proj", "experts.down_proj")


def _setup(block="trinity", **optim):
    cfg = load_config(None, {"model": {**TINY_MODEL, "block": block},
                             "optim": {"name": "muon", "lr": 3e-4, "muon_lr": 1e-3, **optim}})
    model = build_model(cfg.model, device="cpu")
    return cfg, model, build_optimizer(model, cfg.optim)


def _group_of(opt):
    return {id(p): g for g in opt.param_groups for p in g["params"]}


@pytest.mark.parametrize("block", ["trinity", "normformer"])
def test_hidden_matrices_go_to_muon_and_the_rest_to_adamw(block):
    cfg, model, opt = _setup(block)
    assert isinstance(opt, Muon)
    groups = _group_of(opt)
    names = dict(model.named_parameters())
    assert len(groups) == len(names)  # every trainable parameter exactly once
    for name, p in names.items():
        group = groups[id(p)]
        hidden = name.endswith(MUON_SUFFIXES) or name.endswith("router.gate.weight")
        assert group["kind"] == ("muon" if hidden else "adamw"), name
        assert group["lr"] == (1e-3 if hidden else 3e-4), name
        no_decay = name.startswith("embed") or p.ndim < 2
        assert group["weight_decay"] == (0.0 if no_decay else cfg.optim.weight_decay), name
    # Trinity's head is a matrix AdamW keeps (and decays); experts arrive as [E, out, in] stacks.
    assert groups[id(model.lm_head.weight)]["kind"] == "adamw"
    assert any(groups[id(p)]["kind"] == "muon" and p.ndim == 3 for p in names.values())
    assert all(g["fused"] for g in opt.param_groups if g["kind"] == "adamw")  # one AdamW kernel


def test_names_under_training_wrappers_are_still_recognised():
    wrapped = "_orig_mod.layers.3._checkpoint_wrapped_module."
    assert is_muon_param(wrapped + "attn.q_proj.weight", muon_router=False)
    assert is_muon_param(wrapped + "mlp.experts.down_proj", muon_router=False)
    assert is_muon_param(wrapped + "mlp.router.gate.weight", muon_router=True)
    assert not is_muon_param(wrapped + "mlp.router.gate.weight", muon_router=False)
    for name in ("embed.weight", "lm_head.weight", "norm.weight", wrapped + "attn.q_norm.weight",
                 wrapped + "mlp.mid_norm.weight", wrapped + "attn.head_scale"):
        assert not is_muon_param(name, muon_router=True), name


def test_router_gate_can_stay_with_adamw():
    _, model, opt = _setup(muon_router=False)
    groups = _group_of(opt)
    routers = [p for n, p in model.named_parameters() if n.endswith("router.gate.weight")]
    assert routers and all(groups[id(p)]["kind"] == "adamw" for p in routers)


def test_muon_settings_reach_the_group():
    _, _, opt = _setup(muon_scale="rms_match", muon_ns_dtype="fp32", muon_momentum=0.9, muon_ns_steps=3)
    (muon,) = [g for g in opt.param_groups if g["kind"] == "muon"]
    assert (muon["scale"], muon["ns_dtype"], muon["momentum"], muon["ns_steps"]) == ("rms_match", "fp32", 0.9, 3)


def test_one_schedule_scales_both_peaks():
    cfg, _, opt = _setup(warmup_steps=4)
    scheduler = build_scheduler(opt, cfg)
    lrs = {g["kind"]: g["lr"] for g in opt.param_groups}
    assert lrs["muon"] == pytest.approx(1e-3 / 4) and lrs["adamw"] == pytest.approx(3e-4 / 4)
    opt.step()
    scheduler.step()
    lrs = {g["kind"]: g["lr"] for g in opt.param_groups}
    assert lrs["muon"] == pytest.approx(2e-3 / 4) and lrs["adamw"] == pytest.approx(6e-4 / 4)


def test_a_training_step_with_muon_lowers_the_loss():
    _, model, opt = _setup(muon_ns_dtype="fp32", weight_decay=0.0)
    tokens = torch.randint(0, TINY_MODEL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(3):
        out = model(tokens, labels=tokens)
        loss = out.ce_sum / out.num_tokens
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
