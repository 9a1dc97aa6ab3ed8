"""Side-by-side timings of the choices inside our training step, at the shapes of a config
(forward + backward, best of several repetitions, alternating):

- attention of a local layer: one dense T x T sliding-window mask vs the block-wise window, and
  the fused SDPA kernel in fp32 vs bf16 at the blocks' and at a global layer's shapes;
- cross entropy: the fused linear cross entropy vs checkpointed chunks (the path other heads
  take), at a few chunk sizes;
- routed experts: one grouped GEMM per projection vs a per-expert loop vs gate and up fused
  into one GEMM (weights concatenated per call);
- MoE dispatch and combine: our gathers (whose backward is a gather) vs autograd's indexing
  (whose backward scatter-adds into zeros).

    python benchmarks/components.py [--config configs/bench_cpu.toml] [--repeats 6] [--a.b=value ...]
"""

from __future__ import annotations

import os

# Before torch starts OpenMP: on a shared CPU, threads that spin at every barrier while a core is
# taken stall each operator (steps measured 2-10x slower and erratic on the 2-core machine of
# benchmarks/README.md). Set OMP_WAIT_POLICY=ACTIVE to measure the spinning default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from measure import Timings, timed
from trinity_harness.table import markdown_table, ratio
from trinity_train.config import load_config
from trinity_train.model.attention import (build_attention_mask, sliding_window_attention,
                                           sliding_window_blocks)
from trinity_train.model.loss import chunked_cross_entropy
from trinity_train.model.moe import GroupedExperts, PermuteRows, SortTokenCopies

ROOT = Path(__file__).resolve().parent.parent


class ModuleHead(nn.Module):
    """The head as any module other than a bare Linear: the checkpointed-chunk path."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def compare(title: str, cases: dict[str, Callable[[], None]], repeats: int) -> list[list[str]]:
    """Times the cases alternating, prints one line per case, and returns the table's rows:
    (group, case, best ms, its ratio to the group's first case)."""
    timings = {name: Timings() for name in cases}
    for fn in cases.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in cases.items():
            timings[name].add(timed(fn, torch.device("cpu"))[0])
    print(title)
    first = next(iter(timings.values())).best
    rows = []
    for name, t in timings.items():
        print(f"  {name:44s} {t.best * 1e3:8.1f} ms  ({t.best / first:.2f}x the first)", flush=True)
        rows.append([title.split(" (")[0].rstrip(":"), name, f"{t.best * 1e3:.1f}", ratio(t.best, first)])
    return rows


def attention_cases(cfg) -> dict[str, Callable[[], None]]:
    m = cfg.model
    b, t = cfg.train.micro_batch_size, cfg.data.seq_len
    scale = m.head_dim ** -0.5
    sdpa = torch.nn.functional.scaled_dot_product_attention
    generator = torch.Generator().manual_seed(0)
    dense_mask = build_attention_mask(t, m.sliding_window, None, torch.device("cpu"))
    blocks = sliding_window_blocks(t, m.sliding_window, None, b, torch.device("cpu"))
    n, size, keys = blocks.num_blocks, blocks.block, blocks.window + blocks.block

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=generator).to(dtype).requires_grad_()

    def backward_of(fn, *inputs):
        def run():
            out = fn(*inputs)
            out.backward(torch.ones_like(out))
        return run

    heads = (m.num_heads, m.num_kv_heads, m.num_kv_heads)
    bthd = [randn(b, t, h, m.head_dim) for h in heads]  # the model's layout
    bhtd = {dtype: [randn(b, h, t, m.head_dim, dtype=dtype) for h in heads]
            for dtype in (torch.float32, torch.bfloat16)}
    in_blocks = {dtype: [randn(b * n, h, length, m.head_dim, dtype=dtype)
                         for h, length in zip(heads, (size, keys, keys))]
                 for dtype in (torch.float32, torch.bfloat16)}
    return {
        "local, one dense TxT mask": backward_of(
            lambda q, k, v: sdpa(q, k, v, attn_mask=dense_mask, scale=scale, enable_gqa=True),
            *bhtd[torch.float32]),
        f"local, window blocks of {size} (all of it)": backward_of(
            lambda q, k, v: sliding_window_attention(q, k, v, blocks, scale), *bthd),
        "local, the blocks' SDPA kernel alone, fp32": backward_of(
            lambda q, k, v: sdpa(q, k, v, attn_mask=blocks.mask, scale=scale, enable_gqa=True),
            *in_blocks[torch.float32]),
        "local, the blocks' SDPA kernel alone, bf16": backward_of(
            lambda q, k, v: sdpa(q, k, v, attn_mask=blocks.mask, scale=scale, enable_gqa=True),
            *in_blocks[torch.bfloat16]),
        "global, causal SDPA kernel, fp32": backward_of(
            lambda q, k, v: sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=True),
            *bhtd[torch.float32]),
        "global, causal SDPA kernel, bf16": backward_of(
            lambda q, k, v: sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=True),
            *bhtd[torch.bfloat16]),
    }


def loss_cases(cfg) -> dict[str, Callable[[], None]]:
    m = cfg.model
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    generator = torch.Generator().manual_seed(0)
    head = nn.Linear(m.hidden_size, m.vocab_size, bias=False)
    hidden = torch.randn(tokens, m.hidden_size, generator=generator, requires_grad=True)
    labels = torch.randint(0, m.vocab_size, (tokens,), generator=generator)

    def case(module, chunk):
        def run():
            ce, _ = chunked_cross_entropy(hidden, labels, module, chunk)
            ce.backward()
        return run

    cases = {f"checkpointed chunks of {c}": case(ModuleHead(head), c) for c in (tokens, 1024)}
    cases.update({f"fused, chunks of {c}": case(head, c) for c in (tokens, 1024, 512, 256)})
    return cases


def routed_token_copies(cfg, generator):
    """Token copies sorted by expert for one micro-batch, with random routing."""
    m = cfg.model
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    chosen = torch.randint(0, m.num_experts, (tokens * m.num_experts_per_tok,), generator=generator)
    order = torch.argsort(chosen, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    counts = torch.bincount(chosen, minlength=m.num_experts)
    return tokens, order, inverse, counts


def expert_cases(cfg) -> dict[str, Callable[[], None]]:
    m = cfg.model
    generator = torch.Generator().manual_seed(0)
    tokens, _, _, counts = routed_token_copies(cfg, generator)
    grouped = GroupedExperts(m.num_experts, m.hidden_size, m.moe_intermediate_size, "silu", "grouped")
    for p in grouped.parameters():
        nn.init.normal_(p, std=0.02, generator=generator)
    loop = GroupedExperts(m.num_experts, m.hidden_size, m.moe_intermediate_size, "silu", "loop")
    loop.load_state_dict(grouped.state_dict())
    x = torch.randn(int(counts.sum()), m.hidden_size, generator=generator, requires_grad=True)
    grad = torch.randn_like(x)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)

    def fused_gate_up():
        gate_up = torch.cat([grouped.gate_proj, grouped.up_proj], dim=1)
        gate, up = torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
        torch._grouped_mm(h, grouped.down_proj.transpose(-2, -1), offs=offsets).backward(grad)

    return {"grouped GEMM per projection": lambda: grouped(x, counts).backward(grad),
            "per-expert loop": lambda: loop(x, counts).backward(grad),
            "grouped, gate and up fused": fused_gate_up}


def gather_cases(cfg) -> dict[str, Callable[[], None]]:
    m = cfg.model
    generator = torch.Generator().manual_seed(0)
    tokens, order, inverse, _ = routed_token_copies(cfg, generator)
    k = m.num_experts_per_tok
    x = torch.randn(tokens, m.hidden_size, generator=generator, requires_grad=True)
    y = torch.randn(tokens * k, m.hidden_size, generator=generator, requires_grad=True)

    def ours():
        SortTokenCopies.apply(x, order, inverse, k).sum().backward()
        PermuteRows.apply(y, inverse, order).sum().backward()

    def indexing():
        x[order // k].sum().backward()
        y[inverse].sum().backward()

    return {"gathers with gather backward (ours)": ours, "autograd indexing": indexing}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "bench_cpu.toml")
    parser.add_argument("--repeats", type=int, default=6)
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    print(f"{args.config}: forward + backward, best of {args.repeats}, {torch.get_num_threads()} threads")
    rows = compare(f"attention of one layer ({cfg.train.micro_batch_size}x{cfg.data.seq_len} tokens, "
            f"window {cfg.model.sliding_window}):", attention_cases(cfg), args.repeats)
    rows += compare(f"cross entropy over {cfg.model.vocab_size} tokens:", loss_cases(cfg), args.repeats)
    rows += compare(f"routed experts of one layer ({cfg.model.num_experts} x width "
            f"{cfg.model.moe_intermediate_size}, top-{cfg.model.num_experts_per_tok}):",
            expert_cases(cfg), args.repeats)
    rows += compare("MoE dispatch + combine gathers:", gather_cases(cfg), args.repeats)
    print()
    print(markdown_table(["comparison", "case", "best ms (fwd + bwd)", "ratio to the comparison's first case"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
