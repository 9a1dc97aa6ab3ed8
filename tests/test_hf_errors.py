"""What the HF interop refuses, and how: every user mistake is one CheckpointError that names the
field, tensor or path; exports are complete or absent. Also the config variants it must accept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_model
from trinity_train.config import ModelConfig
from trinity_train.model.blocks import BLOCK_VARIANTS
from trinity_train.errors import CheckpointError
from trinity_train.interop import hf
from trinity_train.model import build_model
from trinity_train.interop.hf import (from_hf_config, from_hf_state_dict, load_hf, save_hf, to_hf_config,
                                    to_hf_state_dict)


def small_config(**changes) -> ModelConfig:
    # 2 layers (dense, MoE), both local with the default 1-in-4 global pattern
    return tiny_model(**{"num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 32,
                         "moe_intermediate_size": 8, **changes})


@pytest.fixture
def hf_dir(tmp_path) -> Path:
    torch.manual_seed(0)
    return save_hf(build_model(small_config()), tmp_path / "hf")


def rewrite_config(hf_dir: Path, **changes) -> None:
    path = hf_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def rewrite_weights(hf_dir: Path, edit) -> None:
    path = hf_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


# ---------------------------------------------------------------------------- config.json


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "llama"}, "model_type 'llama', expected 'afmoe'"),
    ({"mup_enabled": False}, "'mup_enabled' is false or absent"),
    ({"tie_word_embeddings": True}, "'tie_word_embeddings' is true"),
    ({"attention_bias": True}, "'attention_bias' is true"),
    ({"hidden_act": "gelu"}, "'hidden_act' is 'gelu'"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "'layer_types'"),
    ({"layer_types": ["sliding_attention"]}, "one entry per layer (2)"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "RoPE type 'yarn'"),
    ({"num_experts": None}, "'num_experts' must be an integer, got None"),
    ({"num_key_value_heads": 3}, "model.num_heads"),  # 2 heads are not divisible into 3 kv groups
], ids=["model_type", "mup", "tied", "attn_bias", "act", "pattern", "length", "rope", "missing", "invalid"])
def test_unrepresentable_config_names_the_field(changes, message):
    hf_cfg = {**to_hf_config(small_config()), **changes}
    with pytest.raises(CheckpointError) as err:
        from_hf_config(hf_cfg)
    assert message in str(err.value)


def test_absent_mup_flag_means_disabled():
    hf_cfg = to_hf_config(small_config())
    del hf_cfg["mup_enabled"]  # transformers' default is False
    with pytest.raises(CheckpointError, match="mup_enabled"):
        from_hf_config(hf_cfg)


def test_layer_types_every_nth_pattern_is_read_back():
    cfg = small_config(num_layers=6, global_every=3)
    hf_cfg = to_hf_config(cfg)
    assert hf_cfg["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    assert hf_cfg["global_attn_every_n_layers"] == 3
    del hf_cfg["global_attn_every_n_layers"]  # the list alone decides
    assert from_hf_config(hf_cfg).global_every == 3


def test_older_config_without_rope_parameters_or_layer_types():
    hf_cfg = to_hf_config(small_config(rope_theta=5e4))
    for key in ("rope_parameters", "layer_types", "dtype"):
        del hf_cfg[key]
    cfg = from_hf_config(hf_cfg)  # flat rope_theta and global_attn_every_n_layers, as transformers 4
    assert (cfg.rope_theta, cfg.global_every) == (5e4, 4)


def test_expert_sizes_the_grouped_gemm_cannot_take_import_with_the_loop(tmp_path):
    cfg = small_config(moe_intermediate_size=12, expert_impl="loop")
    out = save_hf(build_model(cfg), tmp_path / "hf")
    imported, state_dict = load_hf(out)
    assert imported.expert_impl == "loop"
    build_model(imported).load_state_dict(state_dict)


# ---------------------------------------------------------------------------- directories


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf(tmp_path / "nope")


def test_missing_config_json(hf_dir):
    (hf_dir / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_hf(hf_dir)


def test_config_json_not_json(hf_dir):
    (hf_dir / "config.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        load_hf(hf_dir)


def test_wrong_model_type_names_the_directory(hf_dir):
    rewrite_config(hf_dir, model_type="qwen3_moe")
    with pytest.raises(CheckpointError, match=f"cannot import '{hf_dir}'.*model_type 'qwen3_moe'"):
        load_hf(hf_dir)


def test_missing_weights_file(hf_dir):
    (hf_dir / "model.safetensors").unlink()
    (hf_dir / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="only safetensors weights are read"):
        load_hf(hf_dir)


def test_missing_shard_of_an_index(tmp_path):
    torch.manual_seed(0)
    out = save_hf(build_model(small_config()), tmp_path / "hf", max_shard_size="4KB")
    shard = sorted(out.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"weight shard '.*{shard.name}'.* does not exist"):
        load_hf(out)


def test_corrupt_weights_file(hf_dir):
    (hf_dir / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_hf(hf_dir)


# ---------------------------------------------------------------------------- tensors


def test_missing_tensor(hf_dir):
    rewrite_weights(hf_dir, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(CheckpointError, match="1 tensors .* missing.*'model.layers.1.mlp.experts.3.up_proj.weight'"):
        load_hf(hf_dir)


def test_unexpected_tensor(hf_dir):
    rewrite_weights(hf_dir, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(16)}))
    with pytest.raises(CheckpointError, match="not part of the model.*'model.layers.0.self_attn.q_proj.bias'"):
        load_hf(hf_dir)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.k_proj.weight",
                                  "model.layers.1.mlp.experts.2.down_proj.weight"])
def test_shape_mismatch(hf_dir, name):
    rewrite_weights(hf_dir, lambda t: t.update({name: torch.zeros(3, 5)}))
    with pytest.raises(CheckpointError, match=f"'{name}' has shape \\[3, 5\\], but config.json implies"):
        load_hf(hf_dir)


def test_fused_expert_shape_mismatch():
    cfg = small_config()
    fused = {k: v for k, v in to_hf_state_dict(build_model(cfg).state_dict(), cfg).items()
             if ".mlp.experts." not in k}
    fused["model.layers.1.mlp.experts.gate_up_proj"] = torch.zeros(4, 8, 32)  # gate only, no up
    fused["model.layers.1.mlp.experts.down_proj"] = torch.zeros(4, 32, 8)
    with pytest.raises(CheckpointError, match="gate_up_proj' has shape \\[4, 8, 32\\], but config.json implies \\[4, 16, 32\\]"):
        from_hf_state_dict(fused, cfg)


# ---------------------------------------------------------------------------- export


@pytest.mark.parametrize("block", [b for b in BLOCK_VARIANTS if b != "trinity"])
def test_only_the_trinity_block_exports(tmp_path, block):
    cfg = small_config(block=block)
    model = build_model(cfg)
    for convert in (lambda: to_hf_config(cfg), lambda: to_hf_state_dict(model.state_dict(), cfg),
                    lambda: save_hf(model, tmp_path / "hf")):
        with pytest.raises(CheckpointError, match=f"model.block is '{block}': only the 'trinity' block"):
            convert()
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="is a directory that is not empty"):
        save_hf(build_model(small_config()), tmp_path / "hf")
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["keep.txt"]


def test_export_into_an_empty_directory(tmp_path):
    (tmp_path / "hf").mkdir()
    out = save_hf(build_model(small_config()), tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_failed_export_leaves_nothing(tmp_path, monkeypatch):
    def write_then_fail(state_dict, directory, **kwargs):
        (Path(directory) / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(hf, "save_torch_state_dict", write_then_fail)
    with pytest.raises(OSError, match="disk full"):
        save_hf(build_model(small_config()), tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []
