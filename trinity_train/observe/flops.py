"""Model FLOPs utilisation: achieved training FLOP/s over the hardware's peak.

Achieved FLOP/s is tokens/s times the model's training FLOPs per token
(`trinity_train.model.counting.training_flops_per_token`). The peak is `metrics.peak_flops` when
set; otherwise it is measured once at start-up as the best of a few large matmuls in the
training dtype, which on a CPU (no published peak) is the meaningful ceiling.
"""

from __future__ import annotations

import time

import torch


def measure_peak_flops(device: torch.device, dtype: torch.dtype, size: int | None = None, repeats: int = 3) -> float:
    """The best FLOP/s of `repeats` square matmuls of `size` on `device`."""
    size = size or (4096 if device.type == "cuda" else 1024)
    # A private generator: probing must not move the training RNG streams.
    generator = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(size, size, device=device, generator=generator).to(dtype) for _ in range(2))
    torch.matmul(a, b)  # warm-up: kernel selection, allocation
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / max(best, 1e-9)


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops_per_device: float, num_devices: int = 1) -> float:
    return tokens_per_s * flops_per_token / (peak_flops_per_device * num_devices)
