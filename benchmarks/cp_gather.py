"""Context parallelism's global layers: how much of their attention is the key/value all-gather, the
most a ring could hide (issue 32: "gather keys and values over the CP group, or a ring; say which
and why from a measurement").

    python benchmarks/cp_gather.py [--seq-lens 4096,16384] [--cps 2] [--repeats 5]

A global (NoPE) layer under `parallel.cp` all-gathers every key and value of the row, then attends
its T / cp queries to all T keys (`model/context_attention.py`, `GatheredKeys`). A ring attention
sends the same bytes in cp - 1 steps, each overlapped with a partial attention, and merges the
partial softmaxes; the most it can save is the gather's own time, where the attention computes
long enough to hide it. So this times, on `cp` gloo ranks with the default model's attention
shapes (4 query heads, 2 kv heads of 64, fp32, one row, document masking off), the layer's real
code path, forward and backward: the gather alone (all-gather forward, reduce-scatter of the
gradients backward) and the whole attention (gather + SDPA with the [T / cp, T] mask), best of
`--repeats`, rank 0's. One OpenMP thread per rank, all ranks on this machine's cores (loopback).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from trinity_harness.jobs import loadavg
from trinity_harness.table import markdown_table
from trinity_harness.ranks import init_gloo, run_ranks

ROOT = Path(__file__).resolve().parents[1]

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64  # configs/debug.toml


def time_rank(seq_len: int, repeats: int) -> dict:
    """On this rank: best seconds of the gather and of the whole attention, forward + backward."""
    import torch
    import torch.distributed as dist

    from trinity_train.model.context_attention import SequenceShard, gathered_keys, kv_rows, zigzag_index
    from trinity_train.parallel.context_parallel import GroupExchange

    torch.set_num_threads(1)
    init_gloo()
    cp, rank = dist.get_world_size(), dist.get_rank()
    shard = SequenceShard(cp, rank, zigzag_index(seq_len, cp, rank), None, GroupExchange(dist.group.WORLD))
    layer = gathered_keys(shard, batch=1)
    generator = torch.Generator().manual_seed(rank)
    local = seq_len // cp

    def tensor(heads: int) -> torch.Tensor:
        return torch.randn(1, local, heads, HEAD_DIM, generator=generator).requires_grad_()

    q, k, v = tensor(HEADS), tensor(KV_HEADS), tensor(KV_HEADS)

    def gather_only() -> None:
        shard.exchange.all_gather(kv_rows(k, v)).sum().backward()

    def attention() -> None:
        layer.attend(q, k, v, HEAD_DIM ** -0.5).sum().backward()

    best = {}
    for name, fn in (("gather", gather_only), ("attention", attention)):
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        best[name] = min(times)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="4096,16384")
    parser.add_argument("--cps", default="2")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    print(f"# load before: {loadavg()}")
    rows = []
    for cp in map(int, args.cps.split(",")):
        for seq_len in map(int, args.seq_lens.split(",")):
            best = run_ranks(cp, time_rank, seq_len, args.repeats, timeout_s=1800)[0]
            received = (cp - 1) * seq_len // cp * KV_HEADS * HEAD_DIM * 2 * 4
            rows.append([f"{seq_len:,}", cp, f"{best['gather'] * 1e3:,.1f}", f"{best['attention'] * 1e3:,.1f}",
                         f"{best['gather'] / best['attention']:.1%}", f"{received / 2 ** 20:.1f} MiB"])
            print(f"seq_len {seq_len:,}, cp {cp}: gather {rows[-1][2]} ms, attention {rows[-1][3]} ms", flush=True)
    print(f"# load after: {loadavg()}")
    print(markdown_table(["seq_len", "cp", "gather ms (fwd + bwd)", "global-layer attention ms (fwd + bwd)",
                          "gather share", "kv bytes gathered per rank"], rows))


if __name__ == "__main__":
    main()
