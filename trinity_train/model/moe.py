"""Feed-forward layers: the gated dense FFN, and the Trinity mixture of experts built around it.

MoE = sigmoid router with a load-balancing `expert_bias` + one shared expert (unweighted) + top-k
routed experts (dropless). Routed token copies are sorted by expert and handed to
`self.experts(x_sorted, num_tokens_per_expert, alongside)`; that call is the expert-parallel seam
(`parallel/expert_parallel.py` wraps it with all-to-all dispatch and combine, and runs
`alongside`, the shared expert, while the tokens travel), so nothing here knows about
distribution. `GroupedExperts` runs every local expert with one `torch._grouped_mm`
per projection, or with a per-expert loop.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from trinity_train.config import ModelConfig
from trinity_train.model.alignment import GROUPED_MM_ALIGNMENT
from trinity_train.model.norms import LayerNorm
from trinity_train.model.precision import compute_dtype



def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gate activation of a GLU: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, as in Gemma)."""
    if name == "silu":
        return F.silu
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"unknown activation {name!r}")


class FeedForward(nn.Module):
    """`down(act(gate(x)) * up(x))`; with `mid_norm_eps` a LayerNorm after the activation
    (NormFormer's FFN norm)."""

    def __init__(self, hidden_size: int, inner_size: int, activation: str,
                 mid_norm_eps: float | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, inner_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, inner_size, bias=False)
        self.down_proj = nn.Linear(inner_size, hidden_size, bias=False)
        self.mid_norm = LayerNorm(inner_size, mid_norm_eps) if mid_norm_eps is not None else None
        self.act = activation_fn(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.gate_proj(x)) * self.up_proj(x)
        if self.mid_norm is not None:
            h = self.mid_norm(h)
        return self.down_proj(h)


class Routing(NamedTuple):
    logits: torch.Tensor  # [N, E] fp32
    scores: torch.Tensor  # [N, E] fp32, sigmoid(logits)
    weights: torch.Tensor  # [N, k] fp32, normalised unbiased scores of the chosen experts * scale
    experts: torch.Tensor  # [N, k] long, chosen expert ids


class Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, route_scale: float,
                 fp32: bool = True):
        super().__init__()
        self.top_k = top_k
        self.route_scale = route_scale
        self.fp32 = fp32
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor) -> Routing:
        if self.fp32:
            # Top-k picks flip on bf16 rounding of close scores; the logits are a tiny GEMM, so
            # they are computed in fp32 whatever autocast or FSDP's param dtype says.
            with torch.autocast(device_type=x.device.type, enabled=False):
                logits = F.linear(x.float(), self.gate.weight.float())
        else:
            logits = self.gate(x).float()
        scores = torch.sigmoid(logits)
        # The bias steers which experts are chosen, never how much they weigh.
        _, chosen = torch.topk(scores + expert_bias, k=self.top_k, dim=-1)
        top = scores.gather(-1, chosen)
        weights = top / (top.sum(dim=-1, keepdim=True) + 1e-20) * self.route_scale
        return Routing(logits, scores, weights, chosen)


class GroupedExperts(nn.Module):
    """All routed experts of one layer as stacked weights: gate/up [E, I, d], down [E, d, I]."""

    def __init__(self, num_experts: int, hidden_size: int, inner_size: int, activation: str,
                 impl: str):
        super().__init__()
        self.impl = impl
        self.gate_proj = nn.Parameter(torch.empty(num_experts, inner_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, inner_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, inner_size))
        self.act = activation_fn(activation)

    # Compiled blocks run the experts eagerly: their group sizes are data-dependent, and the
    # compiler's shape rules for _grouped_mm only admit bf16 (the eager CPU kernel takes fp32).
    @torch.compiler.disable
    def forward(self, x_sorted: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                alongside: Callable[[], None] | None = None) -> torch.Tensor:
        """x_sorted [N, d]: token copies grouped by expert in expert order; counts [E] long.
        `alongside`: the caller's work that does not need the experts, run once, here after them;
        split over ranks (parallel/expert_parallel.py), while the tokens travel to them."""
        if self.impl == "grouped" and x_sorted.shape[0] > 0:
            out = self._grouped(x_sorted, num_tokens_per_expert)
        else:  # the loop also covers an empty batch, whose backward the grouped kernel rejects
            out = self._loop(x_sorted, num_tokens_per_expert)
        if alongside is not None:
            alongside()
        return out

    def _grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        # Autocast does not cover _grouped_mm; compute in its dtype as nn.Linear would.
        dtype = compute_dtype(x)
        x, gate, up, down = (t.to(dtype) for t in (x, self.gate_proj, self.up_proj, self.down_proj))

        def grouped(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            out = torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)
            if out.requires_grad:
                # The kernel's backward rejects broadcast (zero-stride) incoming gradients.
                out.register_hook(lambda g: g.contiguous())
            return out

        h = self.act(grouped(x, gate)) * grouped(x, up)
        return grouped(h, down)

    def _loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outputs = []
        for e, chunk in enumerate(torch.split(x, counts.tolist())):
            h = self.act(F.linear(chunk, self.gate_proj[e])) * F.linear(chunk, self.up_proj[e])
            outputs.append(F.linear(h, self.down_proj[e]))
        return torch.cat(outputs)


class MoEAux(NamedTuple):
    """What one MoE layer reports besides its output."""

    tokens_per_expert: torch.Tensor  # [E] fp32, detached
    aux_loss: torch.Tensor  # fp32 scalar, alpha-weighted sequence-wise balance loss (0 if off)
    router_z: torch.Tensor | None  # [B, T] fp32 logsumexp(router logits)^2, None if z-loss is off
    # [2, B, E] fp32, the aux loss's statistics of this rank's tokens (`sequence_balance`); None
    # when the aux loss is off. Context parallelism sums them over the rows' ranks.
    balance: torch.Tensor | None = None


def sequence_balance(scores: torch.Tensor, experts: torch.Tensor, batch: int, top_k: int) -> torch.Tensor:
    """Per sequence: [0] how often each expert is chosen, [1] the scores normalised over all
    experts, summed over the tokens. scores [N, E], experts [N, k] with N = batch * T. [2, B, E]."""
    num_experts = scores.shape[-1]
    seq_len = scores.shape[0] // batch
    chosen = experts.view(batch, seq_len * top_k)
    counts = torch.zeros(batch, num_experts, device=scores.device, dtype=torch.float32)
    counts.scatter_add_(1, chosen, torch.ones_like(chosen, dtype=torch.float32))
    score_sums = (scores / scores.sum(dim=-1, keepdim=True)).view(batch, seq_len, num_experts).sum(dim=1)
    return torch.stack([counts, score_sums])


def balance_loss(balance: torch.Tensor, seq_len: int, top_k: int, alpha: float) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss `alpha * sum_i f_i * P_i`, averaged over sequences,
    from the `sequence_balance` statistics of sequences of `seq_len` tokens:
    f_i = E / (k T) * (times expert i is chosen in the sequence); P_i = the mean over the sequence
    of the normalised scores."""
    counts, score_sums = balance
    num_experts = counts.shape[-1]
    f = counts * (num_experts / (top_k * seq_len))
    p = score_sums / seq_len
    return alpha * (f * p).sum(dim=-1).mean()


def sequence_aux_loss(scores: torch.Tensor, experts: torch.Tensor, batch: int, top_k: int,
                      alpha: float) -> torch.Tensor:
    """The balance loss of whole sequences: scores [N, E], experts [N, k] with N = batch * T."""
    return balance_loss(sequence_balance(scores, experts, batch, top_k), scores.shape[0] // batch, top_k, alpha)


# Both gathers below have a gather as their backward (index_select by the inverse permutation)
# instead of autograd's scatter-add into zeros: faster on CPUs and, with no rows colliding,
# deterministic on GPUs.


class SortTokenCopies(torch.autograd.Function):
    """x [N, d] -> its N*k token copies in expert order, x[order // k]; copy i*k + j is the j-th
    choice of token i, and `inverse` is the inverse permutation of `order`. Public for the
    benchmarks that time it alone (benchmarks/components.py) and the tests of its gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor,
                top_k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return x.index_select(0, order // top_k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        grad_copies = grad.index_select(0, inverse)  # back in token order
        # (For bf16 copies the sum still accumulates in fp32: torch's reductions do.)
        return grad_copies.view(-1, ctx.top_k, grad.shape[-1]).sum(dim=1), None, None, None


class PermuteRows(torch.autograd.Function):
    """x[perm] for a permutation whose inverse `inverse` is known (public, as `SortTokenCopies`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _Deferred:
    """`module(x)`, computed when called (once, without arguments) and kept in `result`."""

    def __init__(self, module: nn.Module, x: torch.Tensor):
        self.module, self.x = module, x
        self.result: torch.Tensor | None = None

    def __call__(self) -> None:
        self.result = self.module(self.x)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, activation: str, mid_norm_eps: float | None = None):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.aux_loss_alpha = cfg.aux_loss_alpha
        self.z_loss = cfg.z_loss_weight > 0
        self.router = Router(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                             cfg.route_scale, cfg.router_fp32)
        # NormFormer's mid norm goes into the shared expert like the dense FFN; routed experts stay
        # plain so the grouped GEMM and the expert-parallel path are the same for every variant.
        self.shared_expert = (
            FeedForward(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts,
                        activation, mid_norm_eps)
            if cfg.num_shared_experts > 0 else None)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                      activation, cfg.expert_impl)
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.register_buffer("bias_momentum", torch.zeros(cfg.num_experts, dtype=torch.float32))

    def reset_parameters(self) -> None:
        self.expert_bias.zero_()
        self.bias_momentum.zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEAux]:
        batch, seq_len, hidden = x.shape
        flat = x.reshape(-1, hidden)
        routing = self.router(flat, self.expert_bias)

        # Sort the N*k token copies by expert; `inverse` puts the results back in token order.
        chosen = routing.experts.reshape(-1)
        order = torch.argsort(chosen, stable=True)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(),
                                                                          device=order.device))
        # A scatter rather than bincount, whose output size depends on the data (a graph break).
        counts = torch.zeros_like(self.expert_bias, dtype=torch.long).scatter_add_(
            0, chosen, torch.ones_like(chosen))
        # Under autocast the copies travel in the matmul dtype: one cast of the N tokens instead of
        # N*k copies, and half the bytes through the gathers (and the expert-parallel all-to-all).
        copies = SortTokenCopies.apply(flat.to(compute_dtype(flat)), order, inverse, self.top_k)
        # The shared expert needs no routed result: the experts' call runs it while the expert-
        # parallel all-to-all carries the tokens (nothing else to compute then). A compiled
        # block keeps it in its graph instead (the experts' call is eager).
        shared = (_Deferred(self.shared_expert, flat)
                  if self.shared_expert is not None and not torch.compiler.is_compiling() else None)
        routed = self.experts(copies, counts, shared)
        routed = PermuteRows.apply(routed, inverse, order).view(-1, self.top_k, hidden)
        # The k weighted copies of a token summed as one batched product (deterministic, unlike
        # index_add), in fp32 under autocast too: the routing weights stay exact, and a
        # mixed-dtype multiply would take the CPU's slow casting path.
        with torch.autocast(x.device.type, enabled=False):
            out = torch.einsum("tk,tkh->th", routing.weights, routed.float()).to(x.dtype)
        if self.shared_expert is not None:
            out = out + (shared.result if shared is not None else self.shared_expert(flat))

        balance, aux = None, torch.zeros((), device=x.device)
        if self.aux_loss_alpha > 0:
            balance = sequence_balance(routing.scores, routing.experts, batch, self.top_k)
            aux = balance_loss(balance, seq_len, self.top_k, self.aux_loss_alpha)
        router_z = (torch.logsumexp(routing.logits, dim=-1).square().view(batch, seq_len)
                    if self.z_loss else None)
        return out.view(batch, seq_len, hidden), MoEAux(counts.detach().float(), aux, router_z, balance)


@torch.no_grad()
def update_expert_bias(expert_bias: torch.Tensor, bias_momentum: torch.Tensor,
                       counts: torch.Tensor, rule: str, *, gamma: float, smebu_lambda: float,
                       smebu_beta: float, smebu_kappa: float) -> None:
    """One aux-loss-free balancing step, in place, from the step's tokens per expert `counts`.

    sign:  db = gamma * sign(mean(n) - n), centred; b += db.
    smebu: v = (mean(n) - n) / mean(n); db = lambda * tanh(kappa * v), centred;
           m = beta * m + (1 - beta) * db; b += m.
    Centring keeps the mean bias at zero, so only the relative preference between experts moves.
    """
    if rule == "none":
        return
    n = counts.to(device=expert_bias.device, dtype=torch.float32)
    mean = n.mean()
    if rule == "sign":
        delta = gamma * torch.sign(mean - n)
        expert_bias += delta - delta.mean()
    elif rule == "smebu":
        # The clamp only matters when no token was routed; then v = 0 rather than 0/0.
        delta = smebu_lambda * torch.tanh(smebu_kappa * (mean - n) / mean.clamp_min(1e-12))
        bias_momentum.mul_(smebu_beta).add_((1 - smebu_beta) * (delta - delta.mean()))
        expert_bias += bias_momentum
    else:
        raise ValueError(f"unknown load-balancing rule {rule!r}")


def expert_alignment_problem(cfg: ModelConfig) -> str | None:
    """Why `cfg` cannot use the grouped GEMM path, or None when it can."""
    if cfg.expert_impl != "grouped":
        return None
    bad = [f"model.{name}={getattr(cfg, name)}" for name in ("hidden_size", "moe_intermediate_size")
           if getattr(cfg, name) % GROUPED_MM_ALIGNMENT]
    if not bad:
        return None
    return (f"model.expert_impl='grouped' needs model.hidden_size and model.moe_intermediate_size "
            f"to be multiples of {GROUPED_MM_ALIGNMENT} (torch._grouped_mm's 16-byte stride rule), "
            f"got {', '.join(bad)}; change the sizes or set model.expert_impl='loop'")

