"""What Muon costs next to the forward and backward it follows.

1. One process: the optimizer step (Muon, and AdamW beside it) as a fraction of the forward and
   backward time of one optimizer step of the benchmark config (target for Muon: <= 0.15).
2. Two gloo ranks with the model under FSDP2: the Newton-Schulz FLOPs each rank performs,
   relative to one process performing all of them (target: about 0.5 each, summing to 1).

The benchmark config is configs/debug.toml with 4 micro-batches of 8 x 256 tokens per optimizer
step (8192 tokens, still a small batch: Muon's relative cost falls as the batch grows).

    python benchmarks/muon_overhead.py [--repeats 5] [--a.b=value overrides...]
"""

from __future__ import annotations

import os

# Before torch starts OpenMP: on a shared CPU, threads spinning at barriers stall each operator
# (2-10x slower, erratic steps). Set OMP_WAIT_POLICY=ACTIVE to measure the spinning default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.flop_counter import FlopCounterMode

from trinity_harness.table import markdown_table
from trinity_train.config import Config, load_config
from trinity_train.model import build_model
from trinity_train.optim.groups import build_optimizer
from trinity_train.parallel.process_group import destroy_distributed, leave_together

ROOT = Path(__file__).resolve().parent.parent
BENCHMARK_OVERRIDES = ["--train.grad_accum=4"]


def benchmark_config(overrides: list[str], optimizer: str) -> Config:
    return load_config(ROOT / "configs" / "debug.toml",
                       BENCHMARK_OVERRIDES + overrides + [f"--optim.name={optimizer}"])


def random_batch(cfg: Config, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.data.seq_len),
                         generator=gen)


def forward_backward(model, cfg: Config) -> None:
    for micro in range(cfg.train.grad_accum):
        tokens = random_batch(cfg, micro)
        out = model(tokens, labels=tokens)
        (out.ce_sum / out.num_tokens + out.aux_loss + out.z_loss).backward()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step_fraction(cfg: Config, repeats: int) -> tuple[float, float, float]:
    """Median (fwd+bwd seconds, optimizer-step seconds) over `repeats`, after one warm-up."""
    torch.manual_seed(0)
    model = build_model(cfg.model, device="cpu")
    opt = build_optimizer(model, cfg.optim)
    fwd_bwd, steps = [], []
    for _ in range(repeats + 1):
        opt.zero_grad(set_to_none=True)
        fwd_bwd.append(timed(lambda: forward_backward(model, cfg)))
        steps.append(timed(opt.step))
    fb, st = statistics.median(fwd_bwd[1:]), statistics.median(steps[1:])
    return fb, st, st / fb


def _ns_flops_on_rank(rank: int, world: int, init_file: str, out_dir: str, overrides: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = benchmark_config(overrides + ["--train.micro_batch_size=1", "--train.grad_accum=1",
                                            "--data.seq_len=32"], "muon")
        torch.manual_seed(0)
        model = build_model(cfg.model, device="cpu")
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = build_optimizer(model, cfg.optim)
        forward_backward(model, cfg)
        with FlopCounterMode(display=False) as counter:  # the Muon step's only matmuls are NS
            opt.step()
        Path(out_dir, f"rank{rank}").write_text(str(counter.get_total_flops()))
        leave_together()
    finally:
        destroy_distributed()


def single_process_ns_flops(overrides: list[str]) -> int:
    cfg = benchmark_config(overrides + ["--train.micro_batch_size=1", "--train.grad_accum=1",
                                        "--data.seq_len=32"], "muon")
    torch.manual_seed(0)
    model = build_model(cfg.model, device="cpu")
    opt = build_optimizer(model, cfg.optim)
    forward_backward(model, cfg)
    with FlopCounterMode(display=False) as counter:
        opt.step()
    return counter.get_total_flops()


def per_rank_ns_flops(world: int, overrides: list[str]) -> list[int]:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_ns_flops_on_rank, args=(world, os.path.join(out_dir, "init"), out_dir, overrides),
                           nprocs=world, start_method="spawn")
        return [int(Path(out_dir, f"rank{r}").read_text()) for r in range(world)]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args, overrides = parser.parse_known_args(argv)
    cfg = benchmark_config(overrides, "muon")
    tokens = cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.data.seq_len
    print(f"benchmark config: configs/debug.toml {' '.join(BENCHMARK_OVERRIDES + overrides)} "
          f"({tokens} tokens per optimizer step, {torch.get_num_threads()} CPU threads)")

    rows = []
    print("\n1. optimizer step / forward+backward, one process (median of "
          f"{args.repeats}, after a warm-up)")
    for name in ("muon", "adamw"):
        fb, st, frac = step_fraction(benchmark_config(overrides, name), args.repeats)
        target = "  (target <= 0.15)" if name == "muon" else ""
        print(f"   {name:5s}: fwd+bwd {fb * 1e3:8.1f} ms   step {st * 1e3:7.1f} ms   "
              f"fraction {frac:.3f}{target}", flush=True)
        rows.append([f"{name}: optimizer step / fwd+bwd, one process", f"{fb * 1e3:.1f} ms", f"{st * 1e3:.1f} ms",
                     f"{frac:.3f}", "<= 0.15" if name == "muon" else ""])

    print("\n2. Newton-Schulz FLOPs per rank / one process doing all of them, FSDP2 on 2 ranks")
    total = single_process_ns_flops(overrides)
    per_rank = per_rank_ns_flops(2, overrides)
    for rank, flops in enumerate(per_rank):
        print(f"   rank {rank}: {flops / 1e9:7.3f} GFLOP  fraction {flops / total:.3f}  (target ~0.5)")
        rows.append([f"Newton-Schulz FLOPs, FSDP2 rank {rank} / one process", f"{total / 1e9:.3f} GFLOP",
                     f"{flops / 1e9:.3f} GFLOP", f"{flops / total:.3f}", "~0.5"])
    print(f"   one process: {total / 1e9:7.3f} GFLOP; ranks together: {sum(per_rank) / total:.3f}")
    rows.append(["Newton-Schulz FLOPs, the 2 ranks together / one process", f"{total / 1e9:.3f} GFLOP",
                 f"{sum(per_rank) / 1e9:.3f} GFLOP", f"{sum(per_rank) / total:.3f}", ""])
    print()
    print(markdown_table(["measurement", "denominator (fwd+bwd, or one process)", "numerator (step, or ranks)",
                          "fraction", "target"], rows))

if __name__ == "__main__":
    main(sys.argv[1:])
