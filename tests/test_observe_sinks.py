"""Metrics sinks: JSONL, TensorBoard, W&B (offline without a key), console progress, resume trim,
and the per-layer records (per-layer scalars and histograms)."""

import json
import math

import pytest
import torch

from trinity_train.config import Config
from trinity_train.files import read_jsonl
from trinity_train.observe import MetricsRecorder, measure_peak_flops, mfu, supersede_records_after
from trinity_train.observe.jsonl import JsonlWriter
from trinity_train.observe.scalars import named_values
from trinity_train.records import EventName, RecordKind, event
from trinity_train.rundir import METRICS_FILE, RunDir
from trinity_train.observe.wandb_sink import resolve_mode


def train_record(i, loss=2.0, skipped=False):
    return {"iter": i, "step": i, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 100.0,
            "mfu": 0.1, "skipped": skipped, "moe_cv_per_layer": [0.5, 0.25]}


def test_jsonl_writes_one_object_per_line_with_nan_as_null(tmp_path):
    writer = JsonlWriter(tmp_path / "m.jsonl")
    writer.write({"loss": math.nan, "x": [1.0, math.inf]})
    writer.write({"loss": 1.5})
    writer.close()
    with open(tmp_path / "m.jsonl", "a") as f:
        f.write('{"torn": ')  # a crash mid-line
    assert read_jsonl(tmp_path / "m.jsonl") == [{"loss": None, "x": [1.0, None]}, {"loss": 1.5}]


def test_resume_trim_keeps_records_up_to_the_checkpoint_and_supersedes_the_rest(tmp_path):
    run = RunDir(tmp_path)
    writer = JsonlWriter(run.metrics)
    for i in range(1, 6):
        writer.write({"kind": RecordKind.TRAIN, "iter": i, "step": i})
    writer.write({"kind": RecordKind.VAL, "iter": 5, "step": 5, "val_loss": 3.0})
    writer.close()
    with open(run.metrics, "a") as f:
        f.write('{"kind": RecordKind.TRAIN, "iter": 6, "st')  # the interrupted run died mid-line
    assert supersede_records_after(run, 3) == 3
    assert [r["iter"] for r in read_jsonl(run.metrics)] == [1, 2, 3]
    assert run.metrics.read_text().endswith("}\n")  # the torn line is gone: appends start clean
    assert [(r["kind"], r["iter"], r["superseded_at"]) for r in read_jsonl(run.superseded)] == [
        ("train", 4, 3), ("train", 5, 3), ("val", 5, 3)]
    assert supersede_records_after(run, 3) == 0  # nothing left to move: the file stays as it is
    assert len(read_jsonl(run.superseded)) == 3


def test_recorder_feeds_jsonl_tensorboard_and_offline_wandb(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no key anywhere
    cfg = Config()
    cfg.metrics.tensorboard = True
    cfg.metrics.wandb = True
    cfg.metrics.progress_bar = False
    cfg.train.steps = 2
    recorder = MetricsRecorder(cfg, tmp_path, start_step=0)
    recorder.event(event(EventName.RUN_START, step=0, iter=0, device="cpu", devices=1, resumed_from=None))
    recorder.train(train_record(1))
    recorder.train(train_record(2, loss=math.nan, skipped=True))
    recorder.validation({"iter": 2, "step": 2, "val_loss": 1.75})
    assert recorder.sinks[1].mode == "offline"
    recorder.close()

    records = read_jsonl(tmp_path / METRICS_FILE)
    assert [(r["kind"], r["iter"]) for r in records] == [("train", 1), ("train", 2), ("val", 2)]
    assert records[1]["loss"] is None and records[1]["skipped"] is True
    assert json.loads((tmp_path / "events.jsonl").read_text().splitlines()[0])["event"] == EventName.RUN_START

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp_path / "tb"))
    tb.Reload()
    assert [e.value for e in tb.Scalars("train/loss")] == [2.0]  # the NaN of the skipped step is left out
    assert [e.value for e in tb.Scalars("val/val_loss")] == [1.75]
    assert [e.value for e in tb.Scalars("train/moe_cv_per_layer/1")] == [0.25, 0.25]
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_wandb_mode_follows_the_api_key(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert resolve_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_mode("auto") == "online"
    assert resolve_mode("offline") == "offline"


def test_console_lines_without_a_bar(tmp_path, capsys):
    cfg = Config()
    cfg.metrics.progress_bar = False
    cfg.train.steps = 4
    cfg.train.log_every = 2
    recorder = MetricsRecorder(cfg, tmp_path, start_step=0)
    for i in range(1, 5):
        recorder.train(train_record(i, loss=3.0 - i * 0.5))
    recorder.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 2/4 loss 2.0000 tok/s 100 lr 1.00e-03 eta ")
    assert lines[1].startswith("step 4/4 loss 1.0000")


def test_non_main_ranks_write_nothing(tmp_path):
    recorder = MetricsRecorder(Config(), tmp_path, start_step=0, is_main=False)
    recorder.train(train_record(1))
    recorder.event(event(EventName.RUN_END, step=0, iter=0, wall_s=0.0))
    recorder.close()
    assert list(tmp_path.iterdir()) == []


def test_mfu_and_peak_probe():
    assert mfu(tokens_per_s=1000.0, flops_per_token=6e6, peak_flops_per_device=1e10, num_devices=2) == pytest.approx(0.3)
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    assert measure_peak_flops(torch.device("cpu"), torch.float32, size=64) > 0
    assert torch.equal(torch.rand(2), expected)  # probing leaves the training RNG alone


def test_progress_bar_shows_step_loss_throughput_and_eta(tmp_path, capsys):
    cfg = Config()
    cfg.train.steps = 3
    recorder = MetricsRecorder(cfg, tmp_path, start_step=0)
    for i in range(1, 4):
        recorder.train(train_record(i, loss=1.25))
    recorder.validation({"iter": 3, "step": 3, "val_loss": 1.5})
    recorder.close()
    err = capsys.readouterr().err
    assert "3/3" in err and "loss=1.2500" in err and "tok/s=100" in err and "step 3: validation loss 1.5000" in err
    assert "<" in err  # tqdm's elapsed<remaining (the ETA)


def layers_record(i):
    """A `"layers"` record of a 3-layer model whose layers 1 and 2 are MoE with 4 experts."""
    return {"iter": i, "step": i, "grad_norm_attn": [0.5, 0.25, 0.125], "residual_rms": [1.0, 2.0, None],
            "norm_gain": {"attn_norm": [1.0, 0.9, 0.8], "attn_post_norm": [None, None, None], "final_norm": 1.5},
            "moe_layers": [1, 2], "tokens_per_expert": [[4, 0, 2, 2], [1, 1, 3, 3]],
            "router_entropy": [1.2, 1.3], "experts_without_tokens": [1, 0]}


def test_layer_records_flatten_by_layer_with_histograms_of_rows():
    scalars, histograms = named_values(layers_record(7), "layers")
    assert scalars["layers/grad_norm_attn/2"] == 0.125
    assert "layers/residual_rms/2" not in scalars  # null: no value
    assert scalars["layers/norm_gain/attn_norm/1"] == 0.9 and scalars["layers/norm_gain/final_norm"] == 1.5
    assert not any(k.startswith("layers/norm_gain/attn_post_norm") for k in scalars)
    # lists indexed by MoE layer are named by the layer, not the position
    assert scalars["layers/router_entropy/1"] == 1.2 and scalars["layers/router_entropy/2"] == 1.3
    assert scalars["layers/experts_without_tokens/1"] == 1.0
    assert histograms == {"layers/tokens_per_expert/1": [4.0, 0.0, 2.0, 2.0],
                          "layers/tokens_per_expert/2": [1.0, 1.0, 3.0, 3.0]}
    assert not any(k.startswith(("layers/moe_layers", "layers/iter", "layers/tokens_per_expert")) for k in scalars)
    # other records keep positional names
    assert named_values({"moe_cv_per_layer": [0.5, 0.25]}, "train")[0] == {
        "train/moe_cv_per_layer/0": 0.5, "train/moe_cv_per_layer/1": 0.25}


def test_recorder_writes_layer_records_to_every_sink(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = Config()
    cfg.metrics.tensorboard = cfg.metrics.wandb = True
    cfg.metrics.progress_bar = False
    recorder = MetricsRecorder(cfg, tmp_path, start_step=0)
    for i in (1, 2):
        recorder.train(train_record(i))
        recorder.layers(layers_record(i))
    recorder.close()
    assert [(r["kind"], r["iter"]) for r in read_jsonl(tmp_path / METRICS_FILE)] == [
        ("train", 1), ("layers", 1), ("train", 2), ("layers", 2)]
    assert RunDir(tmp_path).read_metrics(RecordKind.LAYERS)[0]["tokens_per_expert"] == [[4, 0, 2, 2], [1, 1, 3, 3]]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp_path / "tb"), size_guidance={"histograms": 0, "scalars": 0})
    tb.Reload()
    assert [e.value for e in tb.Scalars("layers/router_entropy/2")] == pytest.approx([1.3, 1.3])
    assert [e.step for e in tb.Scalars("layers/norm_gain/final_norm")] == [1, 2]
    histogram = tb.Histograms("layers/tokens_per_expert/1")[0].histogram_value
    assert (histogram.num, histogram.min, histogram.max, histogram.sum) == (4, 0.0, 4.0, 8.0)
    assert list((tmp_path / "wandb").glob("offline-run-*"))
