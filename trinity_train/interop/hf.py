"""Hugging Face `afmoe` interop: config and state-dict conversion, safetensors export and import.

Only the `trinity` block is the `AfmoeForCausalLM` architecture (DESIGN §3), so only it converts.
Our routed experts are stacked `[E, out, in]`. Hugging Face stores them either per expert
(`mlp.experts.{j}.{gate,up,down}_proj.weight`: what `save_pretrained` writes and the released
checkpoints hold) or fused (`mlp.experts.gate_up_proj [E, 2I, d]` with the gate rows first, and
`mlp.experts.down_proj [E, d, I]`: what an in-memory `AfmoeForCausalLM` holds). Export writes the
per-expert layout; import reads both.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict
from safetensors import SafetensorError
from safetensors.torch import load_file

from trinity_train.config import Config, ModelConfig, init_std, validate
from trinity_train.errors import CheckpointError, ConfigError
from trinity_train.files import read_json_object, temp_sibling
from trinity_train.interop.tokenizer import write_hf_tokenizer
from trinity_train.model.blocks import global_every, is_global_layer, norm_eps
from trinity_train.model.moe import expert_alignment_problem
from trinity_train.model.transformer import build_model

HF_CONFIG_FILE = "config.json"
HF_WEIGHTS_FILE = "model.safetensors"
HF_INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"

# Names under `layers.{i}.` (ours) and `model.layers.{i}.` (HF); the first matching prefix wins.
_LAYER_PREFIXES = (
    ("attn_norm.", "input_layernorm."),
    ("attn_post_norm.", "post_attention_layernorm."),
    ("mlp_norm.", "pre_mlp_layernorm."),
    ("mlp_post_norm.", "post_mlp_layernorm."),
    ("attn.", "self_attn."),
    ("mlp.shared_expert.", "mlp.shared_experts."),
    ("mlp.", "mlp."),  # dense FFN, router gate, expert bias
)
_TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")
_ROUTED_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)")
# SMEBU momentum is optimizer-like state of ours; afmoe has no such tensor (it starts at zero).
_OURS_ONLY_SUFFIXES = (".mlp.bias_momentum",)
# Norm gains and load-balancing state stay fp32 whatever the dtype of the matrices (DESIGN §3).
_FP32_SUFFIXES = ("norm.weight", ".mlp.expert_bias", ".mlp.bias_momentum")

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ---------------------------------------------------------------------------- config


def _require_trinity(model_cfg: ModelConfig) -> None:
    if model_cfg.block != "trinity":
        raise CheckpointError(
            f"model.block is '{model_cfg.block}': only the 'trinity' block is the Hugging Face afmoe "
            "architecture, so this model cannot be exported to (or imported from) afmoe")


def to_hf_config(model_cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The `config.json` of `AfmoeForCausalLM` for our model config; `dtype` is that of the matrices."""
    _require_trinity(model_cfg)
    m = model_cfg
    dtype_name = _DTYPE_NAMES.get(dtype)
    if dtype_name is None:
        raise CheckpointError(f"cannot export weights of dtype {dtype}: use float32, bfloat16 or float16")
    return {
        "architectures": ["AfmoeForCausalLM"],
        "model_type": "afmoe",
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "moe_intermediate_size": m.moe_intermediate_size,
        "num_hidden_layers": m.num_layers,
        "num_dense_layers": m.num_dense_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.num_experts_per_tok,
        "num_shared_experts": m.num_shared_experts,
        "route_scale": m.route_scale,
        "global_attn_every_n_layers": global_every(m),
        "layer_types": [_layer_type(is_global_layer(m, i)) for i in range(m.num_layers)],
        "sliding_window": m.sliding_window,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "rope_theta": m.rope_theta,  # the flat key is what transformers < 5 reads
        "rms_norm_eps": norm_eps(m),
        "mup_enabled": True,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": init_std(m),
        "dtype": dtype_name,
        "torch_dtype": dtype_name,  # the name transformers < 5 reads
        "use_cache": True,
    }


def _layer_type(is_global: bool) -> str:
    return "full_attention" if is_global else "sliding_attention"


def _int_field(hf: dict, key: str) -> int:
    value = hf.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise CheckpointError(f"config.json field '{key}' must be an integer, got {value!r}")
    return value


def _float_field(hf: dict, key: str) -> float:
    value = hf.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise CheckpointError(f"config.json field '{key}' must be a number, got {value!r}")
    return float(value)


def _rope_theta(hf: dict) -> float:
    """RoPE base from `rope_parameters` (transformers >= 5) or the flat `rope_theta` (older)."""
    params = hf.get("rope_parameters")
    if params is None:  # older configs: theta is flat and `rope_scaling` names any scaling
        params = hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"config.json field 'rope_parameters' must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(
            f"config.json asks for RoPE type {rope_type!r}: only the default RoPE of the trinity "
            "block can be represented")
    if "rope_theta" in params:
        return _float_field(params, "rope_theta")
    if "rope_theta" in hf:
        return _float_field(hf, "rope_theta")
    raise CheckpointError("config.json has neither 'rope_parameters.rope_theta' nor 'rope_theta'")


def _global_every_from_layer_types(hf: dict, num_layers: int) -> int:
    """N such that layer i is global exactly when (i+1) % N == 0, as `layer_types` says."""
    layer_types = hf.get("layer_types")
    if layer_types is None:  # transformers derives the list from this field
        return _int_field(hf, "global_attn_every_n_layers")
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise CheckpointError(
            f"config.json field 'layer_types' must list one entry per layer ({num_layers}), got {layer_types!r}")

    def pattern(n: int) -> list[str]:
        return [_layer_type((i + 1) % n == 0) for i in range(num_layers)]

    declared = hf.get("global_attn_every_n_layers")
    if isinstance(declared, int) and declared > 0 and pattern(declared) == layer_types:
        return declared
    first_global = next((i for i, t in enumerate(layer_types) if t == "full_attention"), num_layers)
    n = first_global + 1
    if pattern(n) != layer_types:
        raise CheckpointError(
            f"config.json field 'layer_types' ({layer_types}) is not a 'global every N layers' pattern: "
            "the trinity block makes layer i global exactly when (i+1) % N == 0")
    return n


def from_hf_config(hf: dict) -> ModelConfig:
    """Our model config for an afmoe `config.json`; refuses what the trinity block cannot represent."""
    if hf.get("model_type") != "afmoe":
        raise CheckpointError(
            f"config.json has model_type {hf.get('model_type')!r}, expected 'afmoe' (a Trinity checkpoint)")
    refusals = (
        (not hf.get("mup_enabled", False), "mup_enabled",
         "is false or absent; the trinity block always scales embeddings by sqrt(hidden_size)"),
        (hf.get("tie_word_embeddings", False), "tie_word_embeddings",
         "is true; the trinity block has an untied lm_head"),
        (hf.get("attention_bias", False), "attention_bias",
         "is true; the trinity block's attention projections have no bias"),
        (hf.get("hidden_act", "silu") != "silu", "hidden_act",
         f"is {hf.get('hidden_act')!r}; the trinity block uses 'silu' (SwiGLU)"),
    )
    for refused, key, why in refusals:
        if refused:
            raise CheckpointError(f"config.json field '{key}' {why}, so this checkpoint cannot be imported")

    num_layers = _int_field(hf, "num_hidden_layers")
    num_heads = _int_field(hf, "num_attention_heads")
    global_n = _global_every_from_layer_types(hf, num_layers)
    has_local_layers = global_n != 1
    model_cfg = ModelConfig(
        vocab_size=_int_field(hf, "vocab_size"),
        hidden_size=_int_field(hf, "hidden_size"),
        num_layers=num_layers,
        num_dense_layers=_int_field(hf, "num_dense_layers"),
        num_heads=num_heads,
        num_kv_heads=num_heads if hf.get("num_key_value_heads") is None else _int_field(hf, "num_key_value_heads"),
        head_dim=_int_field(hf, "head_dim"),
        intermediate_size=_int_field(hf, "intermediate_size"),
        num_experts=_int_field(hf, "num_experts"),
        num_experts_per_tok=_int_field(hf, "num_experts_per_tok"),
        num_shared_experts=_int_field(hf, "num_shared_experts"),
        moe_intermediate_size=_int_field(hf, "moe_intermediate_size"),
        route_scale=_float_field(hf, "route_scale"),
        sliding_window=(_int_field(hf, "sliding_window") if has_local_layers
                        else ModelConfig.sliding_window),  # no local layer: the window is unused
        global_every=global_n,
        rope_theta=_rope_theta(hf),
        norm_eps=_float_field(hf, "rms_norm_eps"),
        block="trinity",
    )
    if expert_alignment_problem(model_cfg) is not None:  # sizes the grouped GEMM cannot take
        model_cfg.expert_impl = "loop"
    try:
        validate(Config(model=model_cfg))
    except ConfigError as e:
        raise CheckpointError(f"config.json does not describe a valid trinity model: {e}") from None
    return model_cfg


# ---------------------------------------------------------------------------- state dict


def _reference_state(model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Names and shapes of our model's state dict for this config, from a storage-free build."""
    return build_model(model_cfg, device="meta").state_dict()


def _hf_name(name: str) -> str:
    """The afmoe name of one of our (non-expert) tensors."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    match = _LAYER_NAME.fullmatch(name)
    if match:
        layer, rest = match.groups()
        for ours, theirs in _LAYER_PREFIXES:
            if rest.startswith(ours):
                return f"model.layers.{layer}.{theirs}{rest[len(ours):]}"
    raise CheckpointError(f"tensor '{name}' has no counterpart in the afmoe architecture")


def _hf_expert_name(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


def _zero_width_shared_expert(layer: int, hidden_size: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """afmoe without shared experts still has a shared-expert MLP, of width 0 (ours has none)."""
    prefix = f"model.layers.{layer}.mlp.shared_experts."
    return {prefix + "gate_proj.weight": torch.zeros(0, hidden_size, dtype=dtype),
            prefix + "up_proj.weight": torch.zeros(0, hidden_size, dtype=dtype),
            prefix + "down_proj.weight": torch.zeros(hidden_size, 0, dtype=dtype)}


def _moe_layers(reference: dict[str, torch.Tensor]) -> list[int]:
    return sorted({int(m[1]) for name in reference if (m := _ROUTED_EXPERTS.fullmatch(name))})


def _in_dtype_of_origin(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if name.endswith(_FP32_SUFFIXES) else tensor


def _shape_error(name: str, got: torch.Size, expected: torch.Size, source: str) -> CheckpointError:
    return CheckpointError(
        f"tensor '{name}' has shape {list(got)}, but {source} implies {list(expected)}")


def _name_list_error(what: str, names: list[str]) -> CheckpointError:
    shown = ", ".join(f"'{n}'" for n in names[:5])
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return CheckpointError(f"{len(names)} {what}: {shown}{more}")


def to_hf_state_dict(sd: dict[str, torch.Tensor], model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict as afmoe tensors (per-expert layout); norms and expert bias in fp32."""
    _require_trinity(model_cfg)
    reference = _reference_state(model_cfg)
    missing = [name for name in reference if name not in sd]
    if missing:
        raise _name_list_error("tensors of the model config are missing from the state dict", missing)
    unexpected = [name for name in sd if name not in reference]
    if unexpected:
        raise _name_list_error("tensors in the state dict are not part of the model config", unexpected)

    out: dict[str, torch.Tensor] = {}
    for name, ref in reference.items():
        tensor = sd[name].detach()
        if tensor.shape != ref.shape:
            raise _shape_error(name, tensor.shape, ref.shape, "the model config")
        if name.endswith(_OURS_ONLY_SUFFIXES):
            continue
        if experts := _ROUTED_EXPERTS.fullmatch(name):
            layer, proj = int(experts[1]), experts[2]
            for j, weight in enumerate(tensor.unbind(0)):
                # a clone, not a view: views of one storage would be taken for tied tensors on save
                out[_hf_expert_name(layer, j, proj)] = weight.clone()
        else:
            out[_hf_name(name)] = _in_dtype_of_origin(name, tensor)
    if model_cfg.num_shared_experts == 0:  # what save_pretrained writes, so transformers finds all
        for layer in _moe_layers(reference):
            out.update(_zero_width_shared_expert(layer, model_cfg.hidden_size, sd["embed.weight"].dtype))
    return out


def _take_routed_experts(hf_sd: dict[str, torch.Tensor], layer: int, reference: dict[str, torch.Tensor],
                         missing: list[str]) -> dict[str, torch.Tensor]:
    """Pop layer `layer`'s routed experts from `hf_sd` (fused or per expert) as our stacked tensors."""
    ours = {proj: f"layers.{layer}.mlp.experts.{proj}" for proj in ("gate_proj", "up_proj", "down_proj")}
    fused_gate_up = f"model.layers.{layer}.mlp.experts.gate_up_proj"
    fused_down = f"model.layers.{layer}.mlp.experts.down_proj"
    out: dict[str, torch.Tensor] = {}
    if fused_gate_up in hf_sd or fused_down in hf_sd:
        gate_shape, up_shape = reference[ours["gate_proj"]].shape, reference[ours["up_proj"]].shape
        expected = torch.Size([gate_shape[0], gate_shape[1] + up_shape[1], gate_shape[2]])
        for name, shape in ((fused_gate_up, expected), (fused_down, reference[ours["down_proj"]].shape)):
            if name not in hf_sd:
                missing.append(name)
            elif hf_sd[name].shape != shape:
                raise _shape_error(name, hf_sd[name].shape, shape, "config.json")
        if fused_gate_up in hf_sd:
            gate, up = hf_sd.pop(fused_gate_up).split([gate_shape[1], up_shape[1]], dim=1)
            out[ours["gate_proj"]], out[ours["up_proj"]] = gate.contiguous(), up.contiguous()
        if fused_down in hf_sd:
            out[ours["down_proj"]] = hf_sd.pop(fused_down)
        return out
    for proj, name in ours.items():
        shape = reference[name].shape
        per_expert = []
        for j in range(shape[0]):
            hf_name = _hf_expert_name(layer, j, proj)
            if hf_name not in hf_sd:
                missing.append(hf_name)
                continue
            weight = hf_sd.pop(hf_name)
            if weight.shape != shape[1:]:
                raise _shape_error(hf_name, weight.shape, shape[1:], "config.json")
            per_expert.append(weight)
        if len(per_expert) == shape[0]:
            out[name] = torch.stack(per_expert)
    return out


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Afmoe tensors (per-expert or fused experts) as our state dict, ready for `load_state_dict`.

    Matrices keep the checkpoint's dtype; norms and expert bias become fp32; SMEBU momentum starts at 0.
    """
    _require_trinity(model_cfg)
    reference = _reference_state(model_cfg)
    remaining = dict(hf_sd)
    missing: list[str] = []
    out: dict[str, torch.Tensor] = {}
    for layer in _moe_layers(reference):
        out.update(_take_routed_experts(remaining, layer, reference, missing))
        if model_cfg.num_shared_experts == 0:
            for name, empty in _zero_width_shared_expert(layer, model_cfg.hidden_size, torch.float32).items():
                if name in remaining and remaining[name].shape == empty.shape:
                    del remaining[name]
    for name, ref in reference.items():
        if name.endswith(_OURS_ONLY_SUFFIXES):
            out[name] = torch.zeros(ref.shape, dtype=ref.dtype)
        elif not _ROUTED_EXPERTS.fullmatch(name):
            hf_name = _hf_name(name)
            if hf_name not in remaining:
                missing.append(hf_name)
                continue
            tensor = remaining.pop(hf_name)
            if tensor.shape != ref.shape:
                raise _shape_error(hf_name, tensor.shape, ref.shape, "config.json")
            out[name] = _in_dtype_of_origin(name, tensor)
    if missing:
        raise _name_list_error("tensors that config.json implies are missing from the weights", missing)
    if remaining:
        raise _name_list_error("tensors in the weights are not part of the model config.json describes",
                               sorted(remaining))
    return out


# ---------------------------------------------------------------------------- files


def save_hf(model: torch.nn.Module, out_dir: str | Path, model_cfg: ModelConfig | None = None,
            max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, tokenizer_file: Path | None = None) -> Path:
    """Write `model` as a `transformers`-loadable afmoe checkpoint: safetensors (sharded with an
    index when larger than `max_shard_size`), `config.json`, and with `tokenizer_file` (a
    `tokenizers` tokenizer.json) the tokenizer files and the special-token ids.

    The directory appears complete or not at all (written under a temporary name, then renamed).
    `model_cfg` defaults to the model's own config. Returns the directory.
    """
    model_cfg = model_cfg if model_cfg is not None else model.cfg
    sd = model.state_dict()
    hf_sd = to_hf_state_dict(sd, model_cfg)
    hf_cfg = to_hf_config(model_cfg, dtype=sd["embed.weight"].dtype)

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is a directory that is not empty" if out.is_dir() else "is a file"
        raise CheckpointError(f"export directory '{out}' {what}: choose a new directory or remove that one")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(out)
    shutil.rmtree(tmp, ignore_errors=True)  # left over by a crashed export of this process id
    tmp.mkdir()
    try:
        save_torch_state_dict(hf_sd, tmp, max_shard_size=max_shard_size)
        if tokenizer_file is not None:
            hf_cfg.update(write_hf_tokenizer(tokenizer_file, tmp, model_cfg.vocab_size))
        (tmp / HF_CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2) + "\n")
        os.replace(tmp, out)  # also replaces an empty `out` directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _read_safetensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    index = hf_dir / HF_INDEX_FILE
    if index.is_file():
        weight_map = read_json_object(index, CheckpointError).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"'{index}' has no 'weight_map' object")
        files = sorted(set(weight_map.values()))
    elif (hf_dir / HF_WEIGHTS_FILE).is_file():
        files = [HF_WEIGHTS_FILE]
    else:
        raise CheckpointError(
            f"'{hf_dir}' has neither {HF_WEIGHTS_FILE} nor {HF_INDEX_FILE}; only safetensors weights are "
            "read (re-save other formats with transformers' save_pretrained)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        path = hf_dir / file
        if not path.is_file():
            raise CheckpointError(f"weight shard '{path}' listed in {HF_INDEX_FILE} does not exist")
        try:
            tensors.update(load_file(path))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"'{path}' is not a readable safetensors file: {e}") from None
    return tensors


def load_hf(hf_dir: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read an afmoe checkpoint directory as (our model config, our state dict)."""
    path = Path(hf_dir)
    if not path.is_dir():
        raise CheckpointError(f"Hugging Face checkpoint directory '{path}' does not exist")
    config_path = path / HF_CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"'{path}' has no {HF_CONFIG_FILE}; is it a Hugging Face model directory?")
    try:
        model_cfg = from_hf_config(read_json_object(config_path, CheckpointError))
        state_dict = from_hf_state_dict(_read_safetensors(path), model_cfg)
    except CheckpointError as e:
        raise CheckpointError(f"cannot import '{path}': {e}") from None
    return model_cfg, state_dict
