"""What one rank computes, measured at the config's shapes: the matmul rate (`matmul_rates`), the
routed experts' grouped matmul (`grouped_rate`), the rate a training step of the config's model,
cut to a few blocks, reaches on the job's own ranks and layout (`step_rate`), and the memory a
rank can use (`usable_memory`).

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

from trinity_train.config import Config, ModelConfig, grad_accum_for, validate
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


def step_model(cfg: Config) -> Config:
    """The config a rank's training step is measured on: the model cut to its first dense block and
    `MOE_BLOCKS` more (the whole model where it has no more, or where the cut is not a valid
    config); the batch, the layout and every other setting the job's."""
    m = cfg.model
    dense = min(m.num_dense_layers, 1)
    layers = min(m.num_layers, dense + MOE_BLOCKS)
    cut = dataclasses.replace(cfg, model=dataclasses.replace(m, num_layers=layers, num_dense_layers=dense))
    try:
        validate(cut)
    except ConfigError:
        return cfg
    return cut


@dataclasses.dataclass(frozen=True)
class StepRate:
    flops: float  # the measured step's FLOPs on this rank (`plan.timing.flops_per_gpu`)
    compute_s: float  # median seconds of its compute (module doc)
    wall_s: float  # median wall seconds of the step
    steps: int  # steps measured (after the warm-up)
    layers: int  # blocks of the measured model

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.compute_s


def step_rate(cfg: Config, dims, device: torch.device, seconds: float, max_steps: int = 20) -> StepRate:
    """A training step of `cfg` (a `step_model`) on the job's own ranks and layout (`dims`, its mesh
    built): the trainer's `TrainingStep` (forward, backward, the guard's verdict, the optimizer)
    with the job's FSDP, EP and TP and, on a CPU, its gloo overlaps, on random tokens. Its compute is
    what the trainer's rank statistics call compute: on a CPU the loop thread's CPU time
    (`health.rank_stats`: a rank blocked in a collective spends none, so the links' time is left
    out); on a GPU the step's wall time (the host does not see the device's work apart from its
    waits: an upper bound that includes any communication left exposed). FLOPs by the planner's
    accounting (`plan.timing.flops_per_gpu`: activation checkpointing's recomputation included).
    One warm-up step, then at most `max_steps` while all of them fit `seconds` (none: the
    warm-up's times)."""
    import types

    import torch.distributed as dist

    from trinity_train.optim.groups import build_optimizer
    from trinity_train.optim.schedule import build_scheduler
    from trinity_train.parallel.gloo.communication import install_gloo_communication
    from trinity_train.plan.timing import flops_per_gpu
    from trinity_train.stability.guard import StepGuard
    from trinity_train.step import TrainingStep
    from trinity_train.train import build_model_for_training

    model = build_model_for_training(cfg, device, dims)
    optimizer = build_optimizer(model, cfg.optim)
    communication = install_gloo_communication(model, optimizer, dims, device, cfg.parallel.reduce_wire_dtype)
    step = TrainingStep(model, optimizer, build_scheduler(optimizer, cfg), StepGuard.for_config(cfg), cfg, device,
                        dims, communication=communication)
    generator = torch.Generator().manual_seed(cfg.train.seed + dims.rank)
    rows = cfg.train.micro_batch_size * grad_accum_for(cfg.train, dims.dp)
    ids = torch.randint(0, cfg.model.vocab_size, (rows, cfg.data.seq_len + 1), generator=generator)
    batch = types.SimpleNamespace(input_ids=ids[:, :-1], labels=ids[:, 1:])

    def one_step(i: int) -> tuple[float, float]:
        if dist.is_initialized():
            dist.barrier()
        synchronize(device)
        wall, cpu = time.perf_counter(), time.thread_time()
        step(batch, i, i)
        synchronize(device)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        return wall, (cpu if device.type == "cpu" else wall)

    def out_of_time(spent: float) -> bool:
        """Whether any rank is out of `seconds`: every rank runs the same steps (a rank that stopped
        alone would leave the others in a collective)."""
        if not dist.is_initialized():
            return spent >= seconds
        from trinity_train.calibrate.links import agreed_max

        return agreed_max(1.0 if spent >= seconds else 0.0)[0] > 0

    warm_up = one_step(0)  # allocations, kernel choice, the first gathers
    times: list[tuple[float, float]] = []
    while len(times) < max_steps and not out_of_time(warm_up[0] + sum(w for w, _ in times)):
        times.append(one_step(len(times) + 1))
    times = times or [warm_up]  # no time for a second step: the warm-up's (a lower rate)
    del step, optimizer, model
    return StepRate(flops_per_gpu(cfg, dims), statistics.median(c for _, c in times),
                    statistics.median(w for w, _ in times), len(times), cfg.model.num_layers)


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
