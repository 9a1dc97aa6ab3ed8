"""Observability: metrics sinks (JSONL, TensorBoard, W&B), MFU accounting, expert-load
statistics and the console progress display."""

from trinity_train.observe.flops import measure_peak_flops, mfu
from trinity_train.observe.moe_stats import expert_load_stats
from trinity_train.observe.recorder import MetricsRecorder, supersede_records_after

__all__ = ["MetricsRecorder", "supersede_records_after", "expert_load_stats",
           "measure_peak_flops", "mfu"]
