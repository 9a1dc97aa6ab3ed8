"""TrinityModel as a whole: the block variants, initialisation, parity with transformers' afmoe,
the output contract, and that every variant learns."""

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from trinity_train.config import init_std
from trinity_train.errors import ConfigError
from trinity_train.model import ModelOutput, build_model
from trinity_train.model.norms import LayerNorm, RMSNorm

VARIANTS = ("trinity", "sandwich", "prenorm", "gemma3", "normformer")


tiny = tiny_model


# The norms each DESIGN row names: {module path within a layer: RMSNorm or LayerNorm}.
EXPECTED_NORMS = {
    "prenorm": {"attn_norm": "rms", "mlp_norm": "rms"},
    "sandwich": {"attn_norm": "rms", "attn_post_norm": "rms", "mlp_norm": "rms", "mlp_post_norm": "rms"},
    "trinity": {"attn_norm": "rms", "attn_post_norm": "rms", "mlp_norm": "rms", "mlp_post_norm": "rms"},
    "gemma3": {"attn_norm": "rms", "attn_post_norm": "rms", "mlp_norm": "rms", "mlp_post_norm": "rms"},
    "normformer": {"attn_norm": "rms", "attn_post_norm": "ln", "mlp_norm": "rms", "mlp.mid_norm": "ln",
                   "mlp.shared_expert.mid_norm": "ln"},
}


def layer_norm_params(model, i: int) -> dict[str, str]:
    """{module path: "rms" | "ln"} of the residual-stream and FFN norms of layer i (not QK-norm)."""
    return {name: "ln" if isinstance(module, LayerNorm) else "rms"
            for name, module in model.layers[i].named_modules()
            if isinstance(module, (RMSNorm, LayerNorm)) and not name.startswith("attn.")}


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_has_exactly_the_norms_of_its_design_row(variant):
    model = build_model(tiny(block=variant), device="meta")
    for i, layer in enumerate(model.layers):
        expected = dict(EXPECTED_NORMS[variant])
        if not layer.is_moe:
            expected.pop("mlp.shared_expert.mid_norm", None)
        else:
            expected.pop("mlp.mid_norm", None)
        assert layer_norm_params(model, i) == expected, f"layer {i}"
        assert (layer.attn.head_scale is not None) == (variant == "normformer")
    assert hasattr(model.norm, "weight") and not hasattr(model.norm, "bias")


def test_trinity_post_norm_gains_start_at_one_over_sqrt_depth_and_pre_norms_at_one():
    cfg = tiny(num_layers=9)
    model = build_model(cfg)
    for layer in model.layers:
        for post in (layer.attn_post_norm, layer.mlp_post_norm):
            torch.testing.assert_close(post.weight, torch.full((32,), 1 / 3.0))
        for pre in (layer.attn_norm, layer.mlp_norm, layer.attn.q_norm, layer.attn.k_norm):
            assert torch.all(pre.weight == 1.0)
    assert torch.all(model.norm.weight == 1.0)


def test_variant_specific_initial_gains_and_buffers():
    sandwich = build_model(tiny(block="sandwich"))
    assert all(torch.all(l.attn_post_norm.weight == 1.0) for l in sandwich.layers)

    gemma = build_model(tiny(block="gemma3"))
    norms = [m for m in gemma.modules() if isinstance(m, RMSNorm)]
    assert norms and all(n.unit_offset and n.eps == 1e-6 and torch.all(n.weight == 0) for n in norms)

    normformer = build_model(tiny(block="normformer"))
    post = normformer.layers[0].attn_post_norm
    assert torch.all(post.weight == 1) and torch.all(post.bias == 0)
    assert all(torch.all(l.attn.head_scale == 1) for l in normformer.layers)

    for moe in sandwich.moe_layers:
        assert torch.all(moe.expert_bias == 0) and torch.all(moe.bias_momentum == 0)


def test_every_matrix_is_truncated_normal_with_the_configured_std():
    cfg = tiny(vocab_size=512, hidden_size=64, moe_intermediate_size=32)
    model = build_model(cfg)
    std = init_std(cfg)
    assert std == pytest.approx(0.5 / math.sqrt(64))
    matrices = {n: p for n, p in model.named_parameters() if p.ndim >= 2}
    assert {"embed.weight", "lm_head.weight", "layers.1.mlp.router.gate.weight",
            "layers.1.mlp.experts.gate_proj", "layers.0.attn.gate_proj.weight"} <= set(matrices)
    for name, p in matrices.items():
        assert p.abs().max() <= 3 * std + 1e-7, name
    everything = torch.cat([p.flatten() for p in matrices.values()])
    # The std of a normal truncated at +-3 sigma is 0.9866 sigma.
    assert everything.std().item() == pytest.approx(0.9866 * std, rel=0.02)


def test_init_is_seeded_and_works_after_materialising_from_meta():
    cfg = tiny(block="normformer")
    torch.manual_seed(7)
    on_cpu = build_model(cfg)
    meta = build_model(cfg, device="meta")
    meta.to_empty(device="cpu")
    torch.manual_seed(7)
    meta.init_weights()
    for (name, a), b in zip(on_cpu.state_dict().items(), meta.state_dict().values()):
        assert torch.equal(a, b), name
    torch.manual_seed(8)
    other = build_model(cfg)
    assert not torch.equal(other.embed.weight, on_cpu.embed.weight)


def test_output_contract_with_and_without_labels():
    cfg = tiny(loss_chunk_tokens=5)
    model = build_model(cfg)
    ids = torch.randint(0, 64, (2, 7))
    labels = torch.randint(0, 64, (2, 7))
    labels[0, :3] = -100
    plain = model(ids)
    assert isinstance(plain, ModelOutput) and plain.logits.shape == (2, 7, 64)
    assert plain.num_tokens.item() == 0 and plain.ce_sum.item() == 0
    out = model(ids, labels=labels)
    assert out.logits is None and out.num_tokens.dtype == torch.long and out.num_tokens.item() == 11
    expected = F.cross_entropy(plain.logits.reshape(-1, 64), labels.reshape(-1), reduction="sum")
    torch.testing.assert_close(out.ce_sum, expected)
    assert out.ce_sum.dtype == torch.float32
    assert out.tokens_per_expert.shape == (3, 4)
    assert out.aux_loss.item() == 0 and out.z_loss.item() == 0


def test_misaligned_widths_on_the_grouped_path_are_a_config_error():
    with pytest.raises(ConfigError, match="moe_intermediate_size=12.*expert_impl='loop'"):
        build_model(tiny(moe_intermediate_size=12))
    build_model(tiny(moe_intermediate_size=12, expert_impl="loop"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_trains(variant):
    torch.manual_seed(0)
    model = build_model(tiny(block=variant))
    ids = torch.randint(0, 64, (4, 12))
    labels = torch.roll(ids, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        out = model(ids, labels=labels)
        loss = out.ce_sum / out.num_tokens
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses


def _to_hf_state_dict(sd: dict) -> dict:
    """Our names -> transformers' afmoe names, written out independently of interop/hf.py."""
    renames = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
               "mlp_norm": "pre_mlp_layernorm", "mlp_post_norm": "post_mlp_layernorm",
               "attn": "self_attn", "shared_expert": "shared_experts"}
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"],
           "lm_head.weight": sd["lm_head.weight"]}
    for key, value in sd.items():
        if not key.startswith("layers.") or key.endswith("bias_momentum") or key.endswith("experts.up_proj"):
            continue
        parts = [renames.get(p, p) for p in key.split(".")]
        if key.endswith("experts.gate_proj"):
            parts[-1] = "gate_up_proj"
            value = torch.cat([value, sd[key.replace("gate_proj", "up_proj")]], dim=1)
        out["model." + ".".join(parts)] = value
    return out


@pytest.mark.parametrize("expert_impl", ["grouped", "loop"])
def test_default_block_matches_transformers_afmoe_logits(expert_impl):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tiny(route_scale=2.5, expert_impl=expert_impl)
    model = build_model(cfg)
    with torch.no_grad():  # move every gain and the expert bias off their initial values
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
        for moe in model.moe_layers:
            moe.expert_bias.copy_(0.1 * torch.randn(4))
    hf_cfg = transformers.AfmoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=4, num_dense_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_experts=4, num_experts_per_tok=2, num_shared_experts=1, route_scale=2.5,
        global_attn_every_n_layers=4, sliding_window=4, mup_enabled=True, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=64)
    hf = transformers.AfmoeForCausalLM._from_config(hf_cfg, attn_implementation="eager").eval()
    hf.load_state_dict(_to_hf_state_dict(model.state_dict()), strict=True)
    ids = torch.randint(0, 64, (2, 11))  # longer than the window; layer 3 is global (NoPE)
    with torch.no_grad():
        ours, theirs = model(ids).logits, hf(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_gemma3_ffn_is_geglu_with_tanh_gelu():
    model = build_model(tiny(block="gemma3"))
    ffn = model.layers[0].mlp
    x = torch.randn(3, 32)
    expected = ffn.down_proj(F.gelu(ffn.gate_proj(x), approximate="tanh") * ffn.up_proj(x))
    torch.testing.assert_close(ffn(x), expected)


def test_normformer_head_scale_weighs_each_head_before_o_proj():
    model = build_model(tiny(block="normformer"))
    attn = model.layers[0].attn
    x = torch.randn(1, 5, 32)
    with torch.no_grad():
        attn.head_scale[1] = 0.0
        scaled = attn(x, None, None)
        attn.head_scale[1] = 1.0
        attn.o_proj.weight[:, 8:16] = 0.0  # head 1's columns
        dropped = attn(x, None, None)
    torch.testing.assert_close(scaled, dropped)
