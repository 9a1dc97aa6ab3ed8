"""Parity with Hugging Face `transformers` afmoe: exported weights give the same logits there,
imported weights give the same logits here, and the conversions lose nothing."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors import safe_open

from conftest import tiny_model
from trinity_train.config import ModelConfig
from trinity_train.model import build_model
from trinity_train.interop.hf import (HF_INDEX_FILE, from_hf_config, from_hf_state_dict, load_hf,
                                    save_hf, to_hf_config, to_hf_state_dict)

SEQ_LEN = 24  # longer than both sliding windows below, so the window actually cuts
TOLERANCE = 1e-4


def tiny_trinity_config() -> ModelConfig:
    # 4 layers: 0 dense, 1-3 MoE; layers 0-2 local (RoPE, window 8), layer 3 global (NoPE).
    # heads * head_dim = 96 != d = 64, as the released models allow.
    return tiny_model(vocab_size=512, hidden_size=64, head_dim=24, intermediate_size=128, num_experts=8,
                      moe_intermediate_size=32, route_scale=2.5, sliding_window=8)


def random_trinity_model(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Our model with every tensor random, including norm gains and a nonzero expert bias."""
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:  # norm gains
                param.uniform_(0.5, 1.5)
        for moe in model.moe_layers:
            moe.expert_bias.normal_(0.0, 0.1)
    return model.to(dtype).eval()


def random_hf_model(seed: int = 1) -> transformers.AfmoeForCausalLM:
    """A transformers afmoe model, independent of our config code, with ALL weights random
    (transformers initialises the router gate and the expert bias to zero)."""
    hf_config = transformers.AfmoeConfig(
        vocab_size=384, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
        num_hidden_layers=5, num_dense_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, num_experts=8, num_experts_per_tok=3, num_shared_experts=2, route_scale=2.826,
        global_attn_every_n_layers=2, sliding_window=6, rope_parameters={"rope_type": "default",
                                                                         "rope_theta": 50000.0},
        rms_norm_eps=1e-6, mup_enabled=True, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AfmoeForCausalLM._from_config(hf_config, attn_implementation="eager",
                                                       dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("expert_bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.05)
    return model.eval()


def tokens(vocab_size: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attn_implementation, max_shard_size",
                         [("eager", "5GB"), ("sdpa", "100KB")], ids=["eager-one-file", "sdpa-sharded"])
def test_exported_model_gives_same_logits_in_transformers(tmp_path, attn_implementation, max_shard_size):
    cfg = tiny_trinity_config()
    ours = random_trinity_model(cfg)
    out_dir = save_hf(ours, tmp_path / "hf", max_shard_size=max_shard_size)
    assert (out_dir / HF_INDEX_FILE).is_file() == (max_shard_size == "100KB")

    theirs = transformers.AfmoeForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, attn_implementation=attn_implementation).eval()
    assert theirs.config.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    ids = tokens(cfg.vocab_size)
    with torch.no_grad():
        diff = (theirs(ids).logits - ours(ids).logits).abs().max().item()
    assert diff <= TOLERANCE


def test_transformers_model_gives_same_logits_here(tmp_path):
    theirs = random_hf_model()
    theirs.save_pretrained(tmp_path / "hf")

    cfg, state_dict = load_hf(tmp_path / "hf")
    assert (cfg.num_layers, cfg.num_dense_layers, cfg.global_every, cfg.num_shared_experts) == (5, 2, 2, 2)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.route_scale) == (50000.0, 1e-6, 2.826)
    ours = build_model(cfg)
    ours.load_state_dict(state_dict)  # strict: every tensor of ours is given, nothing extra
    ours.eval()
    ids = tokens(cfg.vocab_size)
    with torch.no_grad():
        diff = (ours(ids).logits - theirs(ids).logits).abs().max().item()
    assert diff <= TOLERANCE


def test_our_state_dict_round_trips_exactly():
    cfg = tiny_trinity_config()
    sd = random_trinity_model(cfg).state_dict()
    back = from_hf_state_dict(to_hf_state_dict(sd, cfg), cfg)
    assert back.keys() == sd.keys()
    for name, tensor in sd.items():
        assert back[name].dtype == tensor.dtype, name
        assert torch.equal(back[name], tensor), name


def test_transformers_checkpoint_round_trips_exactly(tmp_path):
    theirs = random_hf_model()
    theirs.save_pretrained(tmp_path / "hf")
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        saved = {name: f.get_tensor(name) for name in f.keys()}
    # save_pretrained writes one tensor per expert, the layout we export too
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in saved

    cfg = from_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    back = to_hf_state_dict(from_hf_state_dict(saved, cfg), cfg)
    assert back.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(back[name], tensor), name
    assert from_hf_config(to_hf_config(cfg)) == cfg


def test_fused_expert_layout_imports_like_per_expert_layout(tmp_path):
    theirs = random_hf_model()
    fused = theirs.state_dict()  # in memory, transformers holds experts.gate_up_proj / down_proj
    assert "model.layers.2.mlp.experts.gate_up_proj" in fused
    theirs.save_pretrained(tmp_path / "hf")
    cfg, per_expert = load_hf(tmp_path / "hf")

    from_fused = from_hf_state_dict(fused, cfg)
    assert from_fused.keys() == per_expert.keys()
    for name, tensor in per_expert.items():
        assert torch.equal(from_fused[name], tensor), name


def test_bf16_export_keeps_norms_and_expert_bias_in_fp32(tmp_path):
    cfg = tiny_trinity_config()
    out_dir = save_hf(random_trinity_model(cfg, dtype=torch.bfloat16), tmp_path / "hf")

    assert json.loads((out_dir / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(out_dir / "model.safetensors", "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes["model.layers.1.mlp.expert_bias"] == "F32"
    assert dtypes["model.layers.3.self_attn.q_norm.weight"] == "F32"
    assert dtypes["model.layers.0.post_mlp_layernorm.weight"] == "F32"
    assert dtypes["model.norm.weight"] == "F32"
    assert dtypes["model.layers.1.mlp.experts.0.gate_proj.weight"] == "BF16"
    assert dtypes["lm_head.weight"] == "BF16"

    _, sd = load_hf(out_dir)
    assert sd["layers.1.mlp.expert_bias"].dtype == torch.float32
    assert sd["layers.0.attn_norm.weight"].dtype == torch.float32
    assert sd["layers.1.mlp.experts.up_proj"].dtype == torch.bfloat16
    assert sd["embed.weight"].dtype == torch.bfloat16


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # transformers' own init
def test_model_without_shared_experts_converts_both_ways(tmp_path):
    # transformers keeps a zero-width shared expert where we have none; both sides must accept that
    cfg = dataclasses.replace(tiny_trinity_config(), num_shared_experts=0)
    ours = random_trinity_model(cfg)
    theirs, info = transformers.AfmoeForCausalLM.from_pretrained(
        save_hf(ours, tmp_path / "ours"), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    ids = tokens(cfg.vocab_size)
    with torch.no_grad():
        assert (theirs.eval()(ids).logits - ours(ids).logits).abs().max().item() <= TOLERANCE

    theirs.save_pretrained(tmp_path / "theirs")
    cfg_back, sd = load_hf(tmp_path / "theirs")
    assert cfg_back.num_shared_experts == 0
    for name, tensor in ours.state_dict().items():
        assert torch.equal(sd[name], tensor), name
