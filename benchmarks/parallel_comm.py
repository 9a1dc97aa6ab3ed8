"""What expert parallelism sends and what FSDP saves, measured side by side with the theory.

1. All-to-all traffic of one training step with `ep` expert-parallel gloo ranks: the bytes each
   rank sends to other ranks in every token all-to-all (dispatch and combine, forward and
   backward; a direction's waves summed, `EP_WAVES`), next to the theoretical count per direction
   `tokens x top_k x hidden x bytes x (ep - 1) / ep` (each token copy leaves its rank unless its
   expert is local, which uniform routing makes 1/ep of them).
2. Parameter + optimizer-state memory held by one rank with FSDP over 1, 2 and 4 ranks (AdamW,
   after one step), as a fraction of the unsharded model.

    python benchmarks/parallel_comm.py [--config configs/debug.toml] [--ep 2] [--rows 2]
                                       [--fsdp 1 2 4] [--section.key=value ...]

CPU gloo ranks on this machine; the counts are exact, nothing here is timed.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from trinity_harness.ranks import init_gloo, run_ranks
from trinity_harness.table import markdown_table, ratio
from trinity_train.config import Config, load_config
from trinity_train.parallel.expert_parallel import EP_WAVES, cut_runs
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.parallelize import build_parallel_model
from trinity_train.plan.collectives import process_group

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "debug.toml"
ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default


class AllToAllBytes(TorchDispatchMode):
    """Records, for every token all-to-all, the bytes this rank sends to other ranks."""

    def __init__(self):
        super().__init__()
        self.sent: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is ALL_TO_ALL:
            tensor, _, input_splits, group_name = args
            if tensor.is_floating_point():  # tokens, not the per-expert counts exchanged first
                group = process_group(group_name)
                me = dist.get_group_rank(group, dist.get_rank())
                row_bytes = tensor.element_size() * tensor[0].numel() if tensor.shape[0] else 0
                self.sent.append(sum(s for r, s in enumerate(input_splits) if r != me) * row_bytes)
        return func(*args, **kwargs)


def local_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters and optimizer state this rank holds (its shards only)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    tensors = [local(p) for p in model.parameters()]
    tensors += [local(v) for state in optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def synthetic_batch(cfg: Config, rows: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, cfg.model.vocab_size, (rows, cfg.data.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def one_step(cfg: Config, dims: ParallelDims, rows: int, rank: int):
    model = build_parallel_model(cfg, dims, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, labels = synthetic_batch(cfg, rows, rank)
    out = model(inputs, labels=labels)
    return model, optimizer, out


def measure_all_to_all(cfg: Config, rows: int) -> dict:
    init_gloo()
    dims = ParallelDims.from_config(cfg, dist.get_world_size())
    dims.build_mesh("cpu")
    with AllToAllBytes() as counter:
        model, optimizer, out = one_step(cfg, dims, rows, dist.get_rank())
        forward_calls = len(counter.sent)
        (out.ce_sum / out.num_tokens).backward()
    return {"forward": counter.sent[:forward_calls], "backward": counter.sent[forward_calls:],
            "tokens": rows * cfg.data.seq_len}


def measure_state(cfg: Config, rows: int) -> int:
    world = int(dist.get_world_size()) if dist.is_initialized() else 1
    dims = ParallelDims.from_config(cfg, world)
    if dims.is_distributed:
        dims.build_mesh("cpu")
    model, optimizer, out = one_step(cfg, dims, rows, dims.dp_rank)
    (out.ce_sum / out.num_tokens).backward()
    optimizer.step()  # allocates AdamW's moments
    return local_state_bytes(model, optimizer)


def measure_state_on_ranks(cfg: Config, rows: int) -> int:
    init_gloo()
    return measure_state(cfg, rows)


def report_all_to_all(cfg: Config, ep: int, rows: int) -> list[list[str]]:
    cfg.parallel.ep, cfg.parallel.dp_shard = ep, ep
    per_rank = run_ranks(ep, measure_all_to_all, cfg, rows)
    m = cfg.model
    element = 4  # fp32 activations on the CPU
    tokens = per_rank[0]["tokens"]
    theory = tokens * m.num_experts_per_tok * m.hidden_size * element * (ep - 1) / ep
    moe_layers = m.num_layers - m.num_dense_layers
    print(f"all-to-all bytes sent to other ranks, one step, ep={ep} ({tokens} tokens per rank, "
          f"top-{m.num_experts_per_tok}, hidden {m.hidden_size}, fp32)")
    print(f"  theory per direction per MoE layer: {tokens} x {m.num_experts_per_tok} x "
          f"{m.hidden_size} x {element} x ({ep}-1)/{ep} = {theory:,.0f} B")
    print(f"  {'rank':>4} {'layer':>5} {'pass':>8} {'op':>9} {'measured B':>12} {'/ theory':>9}")
    totals = defaultdict(int)
    waves = len(cut_runs(m.num_experts // ep, EP_WAVES))  # each direction's all-to-alls a layer
    for rank, res in enumerate(per_rank):
        for phase in ("forward", "backward"):
            calls = res[phase]
            assert len(calls) == 2 * waves * moe_layers, (
                f"expected {2 * waves} all-to-alls per MoE layer ({waves} waves each way), got {len(calls)}")
            # Each direction's waves summed. Forward: dispatch then combine per layer; backward runs
            # the layers in reverse and each layer's combine gradient travels first (the dispatch direction).
            calls = [sum(calls[i:i + waves]) for i in range(0, len(calls), waves)]
            for i, sent in enumerate(calls):
                layer = i // 2 if phase == "forward" else moe_layers - 1 - i // 2
                direction = ("dispatch", "combine")[i % 2] if phase == "forward" else (
                    "combine", "dispatch")[i % 2]
                totals[phase] += sent
                print(f"  {rank:>4} {layer:>5} {phase:>8} {direction:>9} {sent:>12,} "
                      f"{sent / theory:>9.2f}")
    calls = 2 * moe_layers * ep
    found = []
    for phase, total in totals.items():
        print(f"  {phase}: mean {total / calls:,.0f} B per all-to-all = {total / calls / theory:.2f} "
              f"x theory (routing at init is near uniform, so near 1)")
        found.append([f"EP={ep} all-to-all, {phase}: mean B per call", f"{total / calls:,.0f}",
                      f"{theory:,.0f} (theory)", ratio(total / calls, theory),
                      "near 1 (routing at init is near uniform)"])
    return found


def report_state(cfg: Config, sizes: list[int], rows: int) -> list[list[str]]:
    print("parameters + AdamW state held by one rank (fp32)")
    baseline, table = None, []
    for n in sizes:
        cfg.parallel.dp_shard, cfg.parallel.ep = n, 1
        held = measure_state(cfg, rows) if n == 1 else run_ranks(n, measure_state_on_ranks, cfg, rows)[0]
        baseline = baseline or held
        print(f"  FSDP={n}: {held / 2**20:8.2f} MiB = {held / baseline:.3f} x FSDP=1"
              f"{'   (target <= 0.55)' if n == 2 else ''}", flush=True)
        table.append([f"FSDP={n}: parameters + AdamW state of one rank, MiB", f"{held / 2**20:.2f}",
                      f"{baseline / 2**20:.2f} (FSDP=1)", ratio(held, baseline, 3), "<= 0.55" if n == 2 else ""])
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel ranks for the traffic count")
    parser.add_argument("--rows", type=int, default=2, help="sequences per rank in the step")
    parser.add_argument("--fsdp", type=int, nargs="+", default=[1, 2, 4], help="FSDP sizes to compare")
    args, overrides = parser.parse_known_args()
    cfg = load_config(args.config, overrides)
    rows = report_all_to_all(cfg, args.ep, args.rows)
    rows += report_state(cfg, args.fsdp, args.rows)
    print(markdown_table(["measurement", "measured", "against", "ratio", "target"], rows))


if __name__ == "__main__":
    main()
