"""Layer statistics against values computed by hand, on a tiny model in one process.

The expected numbers come from the test's own forward hooks (the outputs themselves, concatenated
over micro-batches, reduced with plain torch in float64) and from `.grad` grouped by parameter
name; the collector must agree: exactly up to float64 rounding, and the max/median ratio within
the histogram's stated precision (2^-8, 0.39 %), gradient norms to fp32 rounding (each
gradient's norm is taken in fp32, like the global norm's). Also: activation checkpointing's repeated
forwards do not count, the record reaches metrics.jsonl through the Trainer at the configured
interval, a skipped step's incident report carries the same per-layer gradient norms, and
compiled blocks give the eager values without recompiling.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from conftest import CONFIGS, run_config, shipped_training_configs, tiny_model
from helpers import assert_values_close
from trinity_train.config import Config, load_config
from trinity_train.errors import ConfigError
from trinity_train.files import read_jsonl
from trinity_train.model import build_model
from trinity_train.model.norms import LayerNorm, RMSNorm
from trinity_train.observe import activation_sums
from trinity_train.observe.layer_record import MOE_FIELDS, NORM_GAIN_FIELDS, PER_LAYER_FIELDS
from trinity_train.observe.layer_stats import LayerStatsCollector, per_layer_grad_norms
from trinity_train.parallel.reductions import global_grad_norm
from trinity_train.rundir import RunDir
from trinity_train.stability.incidents import read_incidents
from trinity_train.parallel.parallelize import apply_training_wrappers
from trinity_train.train import Trainer
from trinity_train.records import IncidentAction, RecordKind

MEDIAN_TOLERANCE = activation_sums.MEDIAN_RELATIVE_PRECISION
NUM_LAYERS = 4
MOE_LAYERS = [1, 2, 3]  # TINY_MODEL: one dense layer, then MoE
BLOCKS = ("trinity", "prenorm", "normformer", "gemma3")
# Where each block has post norms (DESIGN §3 table).
POST_NORMS = {"trinity": (True, True), "prenorm": (False, False), "normformer": (True, False),
              "gemma3": (True, True)}


def tiny(block: str):
    """A tiny model with gains and expert biases moved off their initial values: expert 0 of
    layer 1 is never chosen (its bias is far below the others)."""
    torch.manual_seed(0)
    model = build_model(tiny_model(block=block))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (RMSNorm, LayerNorm)):
                offset = 0.0 if isinstance(module, RMSNorm) and module.unit_offset else 1.0
                module.weight.copy_(offset + 0.5 * torch.rand(module.weight.shape, generator=gen) - 0.25)
        for moe in model.moe_layers:
            moe.expert_bias.copy_(0.01 * torch.randn(moe.expert_bias.shape, generator=gen))
        model.layers[1].mlp.expert_bias[0] = -10.0
    return model


def batches(n: int = 2, rows: int = 2, seq: int = 16):
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, 64, (rows, seq), generator=gen) for _ in range(n)]


def armed_forward_backward(model, inputs, collector: LayerStatsCollector) -> torch.Tensor:
    """What TrainingStep does on a statistics iteration before `collect`: each micro-batch's
    forward armed, its backward not; returns the summed tokens per expert."""
    tokens = sum(ids.numel() for ids in inputs)
    counts = None
    for ids in inputs:
        with collector.recording():
            out = model(ids, labels=ids)
        (out.ce_sum / tokens + out.aux_loss).backward()
        counts = out.tokens_per_expert if counts is None else counts + out.tokens_per_expert
    return counts


def stats_step(model, inputs) -> dict:
    collector = LayerStatsCollector(model, every=1)
    return collector.collect(armed_forward_backward(model, inputs, collector))


class Captured:
    """The test's own record of every output the statistics are about, by module name."""

    def __init__(self, model):
        self.outputs: dict[str, list[torch.Tensor]] = {}
        self.handles = []
        for name, module in model.named_modules():
            if re.fullmatch(r"layers\.\d+(\.(attn|attn_post_norm|mlp|mlp_post_norm|mlp\.router))?", name):
                self.handles.append(module.register_forward_hook(self._keep(name)))

    def _keep(self, name):
        def hook(_module, _inputs, output):
            if name.endswith("router"):
                value = (output.scores.detach().clone(), output.experts.detach().clone())
            else:
                value = (output[0] if isinstance(output, tuple) else output).detach().double().clone()
            self.outputs.setdefault(name, []).append(value)
        return hook

    def all(self, name: str) -> torch.Tensor:
        return torch.cat([x.reshape(-1) for x in self.outputs[name]])

    def remove(self):
        for h in self.handles:
            h.remove()


def expected_grad_norms(model) -> dict[str, list[float]]:
    squares = {"attn": [0.0] * NUM_LAYERS, "ffn": [0.0] * NUM_LAYERS}
    for name, p in model.named_parameters():
        m = re.match(r"layers\.(\d+)\.(attn|attn_norm|attn_post_norm|mlp|mlp_norm|mlp_post_norm)\.", name)
        if m and p.grad is not None:
            kind = "attn" if m.group(2).startswith("attn") else "ffn"
            squares[kind][int(m.group(1))] += p.grad.double().square().sum().item()
    return {k: [math.sqrt(s) for s in v] for k, v in squares.items()}


def rms(x: torch.Tensor) -> float:
    return x.square().mean().sqrt().item()


def kurtosis(x: torch.Tensor) -> float:
    centred = x - x.mean()
    return (centred.pow(4).mean() / centred.square().mean().square()).item() - 3.0


@pytest.mark.parametrize("block", BLOCKS)
def test_statistics_equal_values_computed_by_hand(block):
    model = tiny(block)
    captured = Captured(model)
    record = stats_step(model, batches())
    captured.remove()

    expected = expected_grad_norms(model)
    # fp32 norm per gradient (as the global norm), combined in float64
    assert record["grad_norm_attn"] == pytest.approx(expected["attn"], rel=1e-6)
    assert record["grad_norm_ffn"] == pytest.approx(expected["ffn"], rel=1e-6)
    attn_post, ffn_post = POST_NORMS[block]
    for i in range(NUM_LAYERS):
        out = captured.all(f"layers.{i}")
        assert record["residual_rms"][i] == pytest.approx(rms(out), rel=1e-9)
        assert record["act_kurtosis"][i] == pytest.approx(kurtosis(out), rel=1e-7, abs=1e-9)
        ratio = (out.abs().max() / out.abs().median()).item()
        assert abs(record["act_max_over_median"][i] / ratio - 1) <= MEDIAN_TOLERANCE
        assert record["attn_out_rms"][i] == pytest.approx(rms(captured.all(f"layers.{i}.attn")), rel=1e-9)
        assert record["ffn_out_rms"][i] == pytest.approx(rms(captured.all(f"layers.{i}.mlp")), rel=1e-9)
        if attn_post:
            assert record["attn_post_rms"][i] == pytest.approx(
                rms(captured.all(f"layers.{i}.attn_post_norm")), rel=1e-9)
        else:
            assert record["attn_post_rms"][i] is None
        if ffn_post:
            assert record["ffn_post_rms"][i] == pytest.approx(
                rms(captured.all(f"layers.{i}.mlp_post_norm")), rel=1e-9)
        else:
            assert record["ffn_post_rms"][i] is None

    offset = 1.0 if block == "gemma3" else 0.0  # (1 + g): the effective gain
    params = dict(model.named_parameters())
    for kind in NORM_GAIN_FIELDS:
        for i in range(NUM_LAYERS):
            name = f"layers.{i}.{'attn.' if kind in ('q_norm', 'k_norm') else ''}{kind}.weight"
            if name in params:
                want = offset + params[name].double().mean().item()
                assert record["norm_gain"][kind][i] == pytest.approx(want, rel=1e-12), name
            else:
                assert record["norm_gain"][kind][i] is None, name
    assert record["norm_gain"]["final_norm"] == pytest.approx(offset + params["norm.weight"].double().mean().item())
    assert record["norm_gain"]["attn_norm"][0] != pytest.approx(1.0)  # the gains were moved

    assert record["moe_layers"] == MOE_LAYERS
    for j, i in enumerate(MOE_LAYERS):
        scores = torch.cat([s for s, _ in captured.outputs[f"layers.{i}.mlp.router"]]).double()
        chosen = torch.cat([e for _, e in captured.outputs[f"layers.{i}.mlp.router"]])
        counts = torch.bincount(chosen.reshape(-1), minlength=4).tolist()
        assert record["tokens_per_expert"][j] == counts
        assert record["experts_without_tokens"][j] == counts.count(0)
        p = scores / scores.sum(-1, keepdim=True)
        assert record["router_entropy"][j] == pytest.approx(-(p * p.log()).sum(-1).mean().item(), rel=1e-12)
        bias = model.layers[i].mlp.expert_bias
        assert record["expert_bias_spread"][j] == pytest.approx((bias.max() - bias.min()).item())
    assert record["experts_without_tokens"][0] == 1 and record["tokens_per_expert"][0][0] == 0


def test_the_record_has_every_field_of_the_contract():
    record = stats_step(tiny("prenorm"), batches(1))
    for key in PER_LAYER_FIELDS:
        assert len(record[key]) == NUM_LAYERS, key
    assert set(record["norm_gain"]) == {*NORM_GAIN_FIELDS, "final_norm"}
    assert all(len(record[key]) == len(MOE_LAYERS) for key in MOE_FIELDS)
    assert all(len(row) == 4 for row in record["tokens_per_expert"])


def test_layer_gradient_norms_add_up_to_the_global_norm():
    model = tiny("trinity")
    stats_step(model, batches(1))
    norms = per_layer_grad_norms(model)
    outside = [p for name, p in model.named_parameters() if not name.startswith("layers.")]
    total = sum(n * n for kind in norms.values() for n in kind) + sum(p.grad.double().square().sum().item()
                                                                       for p in outside)
    assert math.sqrt(total) == pytest.approx(global_grad_norm(list(model.parameters())).item(), rel=1e-6)


def test_nothing_is_recorded_unless_armed():
    model = tiny("trinity")
    collector = LayerStatsCollector(model, every=3)
    assert [i for i in range(1, 10) if collector.due(i)] == [3, 6, 9]
    assert not LayerStatsCollector(model, every=0).due(0)
    with collector.recording(False):
        model(batches(1)[0])
    model(batches(1)[0])
    assert collector.hooks.forwards() == 0
    assert all(not m._forward_hooks for m in model.modules())  # nothing left behind either


def checkpointed(block: str):
    model = tiny(block)
    cfg = Config(model=tiny_model(block=block))
    cfg.train.activation_checkpointing = True
    return apply_training_wrappers(model, cfg)


def test_activation_checkpointing_recomputations_do_not_count():
    plain = stats_step(tiny("trinity"), batches())
    model = checkpointed("trinity")
    assert any("checkpoint" in type(layer).__name__.lower() for layer in model.layers)
    collector = LayerStatsCollector(model, every=1)
    counts = armed_forward_backward(model, batches(), collector)  # each backward re-runs the blocks
    assert collector.hooks.forwards() == 2  # one per micro-batch, not one more per backward
    sums = collector.hooks.sites[(0, "block")].sums
    assert sums[0].item() == 2 * 2 * 16 * 32  # elements: micro-batches x rows x seq x hidden
    assert_values_close(collector.collect(counts), plain, rel=1e-6)


@pytest.mark.slow  # inductor compiles the blocks
def test_compiled_blocks_give_the_eager_statistics_without_recompiling():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    eager = stats_step(tiny("trinity"), batches())
    model = tiny("trinity")
    cfg = Config(model=tiny_model())
    cfg.train.compile = cfg.train.activation_checkpointing = True
    model = apply_training_wrappers(model, cfg)
    ids = batches(1)[0]
    model(ids, labels=ids).ce_sum.backward()  # compiled, before any statistics
    model.zero_grad()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    compiled = stats_step(model, batches())
    model(ids, labels=ids).ce_sum.backward()  # compiled again, as before
    assert counters["stats"]["unique_graphs"] == graphs  # the statistics step compiled nothing
    torch._dynamo.reset()
    assert_values_close(compiled, eager, rel=1e-6)


def test_trainer_writes_a_layers_record_every_interval(corpus, tmp_path):
    cfg = run_config(corpus, tmp_path / "run", train={"steps": 4, "micro_batch_size": 2, "grad_accum": 2}, eval={"every": 0},
                     metrics={"layer_stats_every": 2}, checkpoint={"every": 0})
    Trainer(cfg).run()
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    layers = [r for r in records if r["kind"] == RecordKind.LAYERS]
    train = {r["iter"]: r for r in records if r["kind"] == RecordKind.TRAIN}
    assert [(r["iter"], r["step"]) for r in layers] == [(2, 2), (4, 4)]
    for r in layers:
        assert len(r["residual_rms"]) == 4 and r["moe_layers"] == [1, 2, 3]
        # Tokens per expert are the step's counts: top-2 of every token of the global batch.
        assert [sum(row) for row in r["tokens_per_expert"]] == [2 * 2 * 16 * 2] * 3
        layer_norms = math.sqrt(sum(n * n for n in r["grad_norm_attn"] + r["grad_norm_ffn"]))
        assert layer_norms < train[r["iter"]]["grad_norm"]  # pre-clip, and a part of the whole


def test_layer_stats_every_must_not_be_negative():
    with pytest.raises(ConfigError, match=r"metrics.layer_stats_every: must be >= 0"):
        load_config(None, ["--metrics.layer_stats_every=-1"])


@pytest.mark.parametrize("path", shipped_training_configs(), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_shipped_config_takes_layer_statistics(path):
    assert load_config(path).metrics.layer_stats_every >= 1


def test_a_skipped_steps_incident_report_has_its_layer_gradient_norms(corpus, tmp_path):
    guard = {"window": 32, "min_history": 4, "max_consecutive_skips": 6,
             "inject": [{"fault": "grad_scale", "first": 9, "factor": 1e4}]}
    cfg = run_config(corpus, tmp_path / "run", train={"steps": 10, "micro_batch_size": 4}, eval={"every": 0},
                     optim={"warmup_steps": 2}, checkpoint={"every": 0}, stability=guard,
                     metrics={"layer_stats_every": 1})
    Trainer(cfg).run()
    run = RunDir(tmp_path / "run")
    (report,) = read_incidents(run)
    assert report["iter"] == 9 and report["action"] == IncidentAction.SKIP
    layers = {r["iter"]: r for r in run.read_metrics(RecordKind.LAYERS)}
    norms = report["layer_grad_norms"]
    # the gradients the statistics of that iteration saw: the same numbers
    assert norms == {"attn": layers[9]["grad_norm_attn"], "ffn": layers[9]["grad_norm_ffn"]}
    assert all(n > 100 * b for n, b in zip(norms["attn"], layers[8]["grad_norm_attn"]))  # the drill's 1e4
