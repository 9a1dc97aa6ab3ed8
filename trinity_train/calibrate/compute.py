"""What one rank computes, measured at the config's shapes: the matmul rate (`matmul_rates`), the
routed experts' grouped matmul (`grouped_rate`), the rate a whole training step reaches
(`step_rate`), and the memory a rank can use (`usable_memory`).

Every rank measures at once, as the job's ranks will compute at once (ranks that share a CPU or a
memory bus share it here too). Rates are the best of repeated calls within the time given (a
shared machine needs a quiet moment), a step's the median of repeated steps after a warm-up.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from trinity_train.config import Config, ModelConfig, validate
from trinity_train.errors import ConfigError

# The training step is measured on the config's model cut to its first dense block and the next
# MOE_BLOCKS blocks (all of a model that has no more): the per-block work is what a step repeats,
# and a released model's whole depth would not fit one rank unsharded.
MOE_BLOCKS = 3
LARGE_SQUARE = 2048  # the peak's square matmul (a device's best case)


def gemm_shapes(m: ModelConfig, tokens: int, loss_chunk_tokens: int) -> list[tuple[int, int, int]]:
    """(rows, inner, cols) of the forward matmuls of one micro-batch of `tokens` tokens: attention
    projections, dense and shared FFNs, one routed expert at its mean load, the head chunk."""
    d, inner = m.hidden_size, m.num_heads * m.head_dim
    per_expert = max(tokens * m.num_experts_per_tok // m.num_experts, 1)
    shared = m.moe_intermediate_size * m.num_shared_experts
    shapes = [(tokens, d, inner), (tokens, d, m.num_kv_heads * m.head_dim), (tokens, inner, d),
              (tokens, d, m.intermediate_size), (tokens, m.intermediate_size, d),
              (per_expert, d, m.moe_intermediate_size), (per_expert, m.moe_intermediate_size, d),
              (min(loss_chunk_tokens, tokens), d, m.vocab_size)]
    if shared:
        shapes += [(tokens, d, shared), (tokens, shared, d)]
    return sorted(set(shapes))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], object], device: torch.device, seconds: float, min_calls: int = 1) -> float:
    """The fastest of repeated calls of `fn` (after one warm-up call, which counts against
    `seconds`): at least `min_calls`, and more while all of them take less than `seconds`."""
    start = time.perf_counter()
    fn()
    synchronize(device)
    best, spent, calls = float("inf"), time.perf_counter() - start, 0
    while calls < min_calls or spent < seconds:
        start = time.perf_counter()
        fn()
        synchronize(device)
        took = time.perf_counter() - start
        best, spent, calls = min(best, took), spent + took, calls + 1
    return best


def matmul_rates(shapes: list[tuple[int, int, int]], dtype: torch.dtype, device: torch.device,
                 seconds_each: float, min_calls: int = 3) -> dict[tuple[int, int, int], float]:
    """FLOP/s of `torch.mm` at each (rows, inner, cols) shape: the best of at least `min_calls`
    calls and `seconds_each`."""
    generator = torch.Generator(device=device).manual_seed(0)
    rates = {}
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, generator=generator).to(dtype)
        b = torch.randn(k, n, device=device, generator=generator).to(dtype)
        best = best_seconds(lambda: torch.mm(a, b), device, seconds_each, min_calls)
        rates[(m, k, n)] = 2.0 * m * k * n / max(best, 1e-9)
    return rates


def weighted_rate(rates: dict[tuple[int, int, int], float]) -> float:
    """One rate for a set of shapes: their FLOPs over their time (each shape run once), so a shape
    counts by the work it does."""
    flops = {s: 2.0 * s[0] * s[1] * s[2] for s in rates}
    return sum(flops.values()) / sum(flops[s] / r for s, r in rates.items())


def grouped_rate(m: ModelConfig, tokens: int, ep: int, dtype: torch.dtype, device: torch.device,
                 seconds: float) -> float | None:
    """FLOP/s of the routed experts' forward (`torch._grouped_mm`, gate, up and down) on a rank's
    local experts (num_experts / ep) at the mean load of `tokens` tokens from each of the ep ranks;
    None for a model without routed experts, experts run as a loop (`model.expert_impl`), or fp32 on
    a GPU (the CUDA kernel takes bf16 only)."""
    if m.num_layers == m.num_dense_layers or m.num_experts == 0 or m.expert_impl != "grouped":
        return None
    if device.type == "cuda" and dtype != torch.bfloat16:
        return None
    local = max(m.num_experts // ep, 1)
    rows = max(tokens * m.num_experts_per_tok * ep // m.num_experts, 1)  # per local expert
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(local * rows, m.hidden_size, device=device, generator=generator).to(dtype)
    up = torch.randn(local, m.moe_intermediate_size, m.hidden_size, device=device, generator=generator).to(dtype)
    down = torch.randn(local, m.hidden_size, m.moe_intermediate_size, device=device, generator=generator).to(dtype)
    offsets = torch.arange(1, local + 1, device=device, dtype=torch.int32) * rows

    def experts() -> torch.Tensor:
        h = torch._grouped_mm(x, up.transpose(-2, -1), offs=offsets)
        h = h * torch._grouped_mm(x, up.transpose(-2, -1), offs=offsets)  # gate and up: same shape
        return torch._grouped_mm(h, down.transpose(-2, -1), offs=offsets)

    flops = 2.0 * local * rows * m.hidden_size * m.moe_intermediate_size * 3
    return flops / max(best_seconds(experts, device, seconds), 1e-9)


def step_model(cfg: Config, ep: int, grad_accum: int) -> Config:
    """The config a rank's training step is measured on: the model cut to one dense block and
    `MOE_BLOCKS` more, its routed experts cut to one rank's share (num_experts / ep, at least
    top-k: each local expert then sees the rows it sees in the job), `grad_accum` micro-batches of
    the config's size a step. The whole model where the cut is not a valid config."""
    m = cfg.model
    dense = min(m.num_dense_layers, 1)
    layers = min(m.num_layers, dense + MOE_BLOCKS)
    experts = max(m.num_experts // ep, m.num_experts_per_tok)
    train = dataclasses.replace(cfg.train, global_batch_size=0, grad_accum=grad_accum)
    cut = dataclasses.replace(cfg, train=train, model=dataclasses.replace(
        m, num_layers=layers, num_dense_layers=dense, num_experts=experts))
    try:
        validate(cut)
    except ConfigError:
        return dataclasses.replace(cfg, train=train)
    return cut


@dataclasses.dataclass(frozen=True)
class StepRate:
    flops: float  # the measured step's FLOPs (`plan.timing.flops_per_gpu`)
    backward_s: float  # median seconds of its forwards and backwards
    optimizer_s: float  # median seconds of its optimizer step (the whole measured model's)
    steps: int  # steps measured (after the warm-up)
    layers: int  # blocks of the measured model
    experts: int  # its routed experts

    def flops_per_s(self, optimizer_shards: int) -> float:
        """The step's rate on a rank of a job whose optimizer work is split `optimizer_shards` ways
        (FSDP: each rank steps its shards, and Muon deals its matrices over the group)."""
        return self.flops / (self.backward_s + self.optimizer_s / optimizer_shards)


def step_rate(cfg: Config, device: torch.device, seconds: float, max_steps: int = 20) -> StepRate:
    """A training step of `cfg` (a `step_model`) on this rank alone: forward, backward and the
    optimizer step on random tokens, timed apart; FLOPs by the planner's accounting
    (`plan.timing.flops_per_gpu`: activation checkpointing's recomputation included). One warm-up
    step, then at most `max_steps` while all of them fit `seconds` (none: the warm-up's times)."""
    from trinity_train.optim.groups import build_optimizer
    from trinity_train.parallel.mesh import ParallelDims
    from trinity_train.plan.timing import flops_per_gpu
    from trinity_train.step import forward_micro_batch
    from trinity_train.train import build_model_for_training

    dims = ParallelDims.one_process()
    model = build_model_for_training(cfg, device)
    optimizer = build_optimizer(model, cfg.optim)
    generator = torch.Generator().manual_seed(cfg.train.seed)
    rows, length = cfg.train.micro_batch_size, cfg.data.seq_len
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.grad_accum, rows, length + 1), generator=generator)
    parts = [{"input_ids": ids[i, :, :-1], "labels": ids[i, :, 1:]} for i in range(cfg.train.grad_accum)]
    tokens = rows * length * cfg.train.grad_accum

    def one_step() -> tuple[float, float]:
        synchronize(device)
        start = time.perf_counter()
        for mb in parts:
            out = forward_micro_batch(model, mb, cfg, device, dims)
            (out.ce_sum / tokens + out.aux_loss + out.z_loss).backward()
        synchronize(device)
        middle = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        return middle - start, time.perf_counter() - middle

    warm_up = one_step()  # allocations, kernel choice
    times: list[tuple[float, float]] = []
    while sum(warm_up) + sum(a + b for a, b in times) < seconds and len(times) < max_steps:
        times.append(one_step())
    times = times or [warm_up]  # no time for a second step: the warm-up's (a lower rate)
    del model, optimizer
    return StepRate(flops_per_gpu(cfg, dims), statistics.median(a for a, _ in times),
                    statistics.median(b for _, b in times), len(times), cfg.model.num_layers, cfg.model.num_experts)


def usable_memory(device: torch.device, ranks_on_node: int) -> int:
    """Bytes a rank can use: a GPU's free memory now (this process's CUDA context already taken:
    a plan on the profile reserves no second one); on a CPU the node's available memory
    (/proc/meminfo's MemAvailable) shared by its ranks."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the measured step's cached blocks are the job's to use
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 // max(ranks_on_node, 1)
    raise ConfigError("calibrate: /proc/meminfo has no MemAvailable line; cannot tell this node's usable memory")
