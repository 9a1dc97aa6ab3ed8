"""Measurement helpers shared by the performance benchmarks: best-of-N timing, the matmul probe
that MFU is measured against, and the training FLOP accounting of the trainer.

Figures on a shared machine are only comparable when taken side by side in one process: every
benchmark here alternates what it compares and keeps the best of several repetitions.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from trinity_train.calibrate.compute import LARGE_SQUARE, gemm_shapes, matmul_rates, synchronize
from trinity_train.config import Config
from trinity_train.model.counting import training_flops_per_token



@dataclass
class Timings:
    """Wall-clock seconds of repeated runs of one thing."""

    seconds: list[float] = field(default_factory=list)

    def add(self, seconds: float) -> None:
        self.seconds.append(seconds)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """(wall seconds, result) of one call, with the device's queue drained on both ends."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


def step_flops(cfg: Config) -> float:
    """Training FLOPs of one optimizer step: the trainer's accounting
    (`training_flops_per_token`) times the tokens of a global batch on this process."""
    tokens = cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.data.seq_len
    return training_flops_per_token(cfg.model, cfg.data.seq_len) * tokens


# The forward matmul shapes of one micro-batch: the ones calibrate measures (one owner).
model_gemm_shapes = gemm_shapes


@dataclass
class ProbeResult:
    dtype: torch.dtype
    flops: dict[tuple[int, int, int], float]  # best FLOP/s of each shape

    @property
    def peak(self) -> float:
        return max(self.flops.values())

    @property
    def peak_shape(self) -> tuple[int, int, int]:
        return max(self.flops, key=self.flops.get)

    def describe(self) -> str:
        m, k, n = self.peak_shape
        name = str(self.dtype).removeprefix("torch.")
        shapes = ", ".join(f"{a}x{b}x{c} {f / 1e9:.0f}" for (a, b, c), f in sorted(self.flops.items()))
        return (f"matmul probe {name}: peak {self.peak / 1e9:.1f} GFLOP/s at {m}x{k}x{n} "
                f"(GFLOP/s per shape: {shapes})")


def matmul_probe(shapes: list[tuple[int, int, int]], dtype: torch.dtype, device: torch.device,
                 repeats: int, min_seconds: float = 0.5, square: int = LARGE_SQUARE) -> ProbeResult:
    """Best FLOP/s of `torch.mm` at each shape and at a `square` one, over at least `repeats`
    calls and `min_seconds` per shape (on a shared machine a quiet moment must come along):
    calibrate's measurement (`calibrate.compute.matmul_rates`)."""
    return ProbeResult(dtype, matmul_rates([*shapes, (square, square, square)], dtype, device, min_seconds,
                                           min_calls=repeats))