"""Per-layer statistics of a training step (DESIGN §8): where in the network trouble starts.

Every `metrics.layer_stats_every` iterations the training step arms the collector around the
forwards of its micro-batches and, after backward and before clipping, calls `collect` for one
`layers` record (`observe/layer_record.py`, docs/CONTRACT.md). Per layer:

- `grad_norm_attn`, `grad_norm_ffn`: the global pre-clip L2 norm of the layer's attention and
  FFN gradients. Attention: every parameter of `layers.{i}.attn.*` (q/k/v/gate/o projections,
  q_norm, k_norm, NormFormer's head_scale), `attn_norm` and `attn_post_norm`. FFN: every
  parameter of `layers.{i}.mlp.*` (dense or shared-expert SwiGLU, NormFormer's mid_norm, the
  router gate, the routed experts), `mlp_norm` and `mlp_post_norm`. The embedding, the final
  norm and the head belong to no layer. (`per_layer_grad_norms`, also used on the gradients of a
  skipped step by incident reports.)
- `residual_rms`: RMS of the block's output (the residual stream after the block);
  `act_max_over_median`: its max |x| over its median |x| (the massive-activation ratio; the median
  from a fixed histogram of |x|, within 0.39 %: `observe/activation_sums.py`); `act_kurtosis`: its
  excess kurtosis over all elements (0 for a Gaussian).
- `attn_out_rms`, `ffn_out_rms`: RMS of each sublayer's output before its post norm;
  `attn_post_rms`, `ffn_post_rms`: after it (null where the block has none).
- `norm_gain`: the mean effective gain of each norm (for the gemma3 block's (1 + g) form,
  1 + mean(g)), `final_norm` too.
- per MoE layer: `tokens_per_expert` (the step's counts, summed over micro-batches and ranks),
  `expert_bias_spread` (max - min of the expert bias the step routed with), `router_entropy` (the
  mean over tokens of the entropy, in nats, of the router's scores normalised to sum 1; ln E at
  most) and `experts_without_tokens`.

Every value is global: activation sums go through `observe/layer_hooks.py`'s one reduction;
gradients and gains are DTensors under FSDP, TP and EP, so each is reduced over its own mesh
(one stacked collective per mesh). With `ParallelDims.one_process()` all of it is the identity.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trinity_train.model.blocks import TransformerBlock
from trinity_train.model.norms import RMSNorm
from trinity_train.observe import activation_sums as sums
from trinity_train.observe import layer_record
from trinity_train.observe.layer_hooks import ActivationHooks
from trinity_train.parallel.mesh import ParallelDims


def blocks_of(model: nn.Module) -> list[TransformerBlock]:
    """The decoder blocks in layer order, whatever wraps them (checkpointing, compile, FSDP)."""
    return [m for m in model.modules() if isinstance(m, TransformerBlock)]


def _parameters(*modules: nn.Module | None) -> list[torch.Tensor]:
    return [p for m in modules if m is not None for p in m.parameters()]


def layer_parameter_groups(block: TransformerBlock) -> dict[str, list[torch.Tensor]]:
    """The parameters whose gradients make a layer's `attn` and `ffn` norms (module docstring)."""
    return {"attn": _parameters(block.attn, block.attn_norm, block.attn_post_norm),
            "ffn": _parameters(block.mlp, block.mlp_norm, block.mlp_post_norm)}


def global_scalars(values: list[torch.Tensor]) -> list[float]:
    """0-d per-rank results as global floats: a DTensor (a norm or sum still pending over the
    ranks of its mesh) is completed, a plain tensor is taken as it is. The DTensors of one mesh
    are stacked and completed together: one collective per mesh, in the same order on every rank."""
    by_mesh: dict[object, list[int]] = {}
    for i, v in enumerate(values):
        by_mesh.setdefault(v.device_mesh if isinstance(v, DTensor) else None, []).append(i)
    out = [0.0] * len(values)
    for mesh, indices in by_mesh.items():
        stacked = torch.stack([values[i] for i in indices])
        if mesh is not None:
            stacked = stacked.full_tensor()
        for i, value in zip(indices, stacked.double().tolist()):
            out[i] = value
    return out


def per_layer_grad_norms(model: nn.Module, dims: ParallelDims | None = None) -> dict[str, list[float]]:
    """{"attn": [L], "ffn": [L]}: the global L2 norm of each layer's attention and FFN gradients
    (read them after backward and before clipping), the same on every rank; every rank must call
    it. `dims` is the run's layout: every gradient of a distributed run is a DTensor (FSDP shards
    all of them), which is reduced over its own mesh, so a plain gradient there would be one
    rank's alone and is refused."""
    dims = dims or ParallelDims.one_process()
    groups = [layer_parameter_groups(block) for block in blocks_of(model)]
    params = [(layer, kind, p) for layer, g in enumerate(groups) for kind, ps in g.items() for p in ps]
    norms = []
    for _, _, p in params:
        if p.grad is None:
            norms.append(torch.zeros((), device=p.device))
            continue
        if dims.is_distributed and not isinstance(p.grad, DTensor):
            raise RuntimeError("per_layer_grad_norms: a plain gradient in a distributed run is not global")
        norms.append(torch.linalg.vector_norm(p.grad.detach()))
    squares = {kind: [0.0] * len(groups) for kind in ("attn", "ffn")}
    for (layer, kind, _), norm in zip(params, global_scalars(norms)):
        squares[kind][layer] += norm * norm
    return {kind: [math.sqrt(s) for s in values] for kind, values in squares.items()}


def _effective_gain(norm: nn.Module, mean: float) -> float:
    return 1.0 + mean if isinstance(norm, RMSNorm) and norm.unit_offset else mean


def norm_gains(model: nn.Module) -> dict:
    """The `norm_gain` object: mean effective gain of every norm, by kind and layer."""
    blocks = blocks_of(model)
    modules: dict[str, list[nn.Module | None]] = {
        "attn_norm": [b.attn_norm for b in blocks], "attn_post_norm": [b.attn_post_norm for b in blocks],
        "mlp_norm": [b.mlp_norm for b in blocks], "mlp_post_norm": [b.mlp_post_norm for b in blocks],
        "q_norm": [b.attn.q_norm for b in blocks], "k_norm": [b.attn.k_norm for b in blocks],
        layer_record.FINAL_NORM: [model.norm]}
    present = [m for ms in modules.values() for m in ms if m is not None]
    totals = global_scalars([m.weight.detach().double().sum() for m in present])
    mean = {id(m): _effective_gain(m, total / m.weight.numel()) for m, total in zip(present, totals)}
    gains: dict = {name: [None if m is None else mean[id(m)] for m in modules[name]]
                   for name in layer_record.NORM_GAIN_FIELDS}
    gains[layer_record.FINAL_NORM] = mean[id(model.norm)]
    return gains


def _mean(count: float, total: float) -> float | None:
    return total / count if count > 0 else None


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class LayerStatsCollector:
    """The layer statistics of a run: arm `recording` around each forward of a statistics
    iteration (`due`), then `collect` once after backward, before clipping."""

    def __init__(self, model: nn.Module, every: int, dims: ParallelDims | None = None):
        self.model = model
        self.every = every
        self.dims = dims or ParallelDims.one_process()
        self.blocks = blocks_of(model)
        device = next(model.parameters()).device
        self.hooks = ActivationHooks(self.blocks, device)

    def due(self, iteration: int) -> bool:
        return self.every > 0 and iteration % self.every == 0

    @contextlib.contextmanager
    def recording(self, active: bool = True) -> Iterator[None]:
        """Record the forward run inside (nothing when not `active`)."""
        if not active:
            yield
            return
        with self.hooks.armed():
            yield

    def collect(self, tokens_per_expert: torch.Tensor) -> dict:
        """The `layers` record without `iter` and `step`, from what the armed forwards gathered,
        the gradients as they are now, and the step's `tokens_per_expert` [M, E] (summed over
        micro-batches and ranks). Every rank must call it; all get the same values."""
        grads = per_layer_grad_norms(self.model, self.dims)
        taken = self.hooks.take(self.dims)
        num_layers = len(self.blocks)

        def per_layer(site: str, read) -> list:
            return [read(*taken[(i, site)]) if (i, site) in taken else None for i in range(num_layers)]

        def square_rms(values, _maxima):
            return sums.rms(values[0], values[1])

        power, hist = slice(0, sums.NUM_POWER_SUMS), slice(sums.NUM_POWER_SUMS, None)
        record = {
            "grad_norm_attn": grads["attn"], "grad_norm_ffn": grads["ffn"],
            "residual_rms": per_layer("block", lambda v, _: sums.rms(v[0], v[2])),
            "attn_out_rms": per_layer("attn", square_rms), "attn_post_rms": per_layer("attn_post", square_rms),
            "ffn_out_rms": per_layer("ffn", square_rms), "ffn_post_rms": per_layer("ffn_post", square_rms),
            "act_max_over_median": per_layer("block", lambda v, m: sums.max_over_median(m[0], v[hist])),
            "act_kurtosis": per_layer("block", lambda v, _: sums.excess_kurtosis(v[power])),
            "norm_gain": norm_gains(self.model),
        }
        moe_layers = [i for i, block in enumerate(self.blocks) if block.is_moe]
        counts = tokens_per_expert.detach().cpu()
        biases = [_whole(self.blocks[i].mlp.expert_bias).detach() for i in moe_layers]
        record.update({
            layer_record.MOE_LAYERS: moe_layers,
            "tokens_per_expert": [[int(c) for c in row] for row in counts.round().long().tolist()],
            "expert_bias_spread": [float(b.max() - b.min()) for b in biases],
            "router_entropy": [_mean(*taken[(i, "router")][0]) for i in moe_layers],
            "experts_without_tokens": [int((row == 0).sum()) for row in counts],
        })
        return record
