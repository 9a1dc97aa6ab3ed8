"""A closed-form model of one rank's memory and traffic per training step (docs/concepts/plan-model.md).

The trace (`plan.trace`) runs the real code on fake tensors and is the reference; this model
says *why* its numbers are what they are, prices a layout in microseconds (the layout search
prices thousands), and is printed beside the trace so that a change to either shows up as a
disagreement. It follows the code it models:

- the parameters of every FSDP unit (`parallel/fsdp.py`: the embedding, one unit per block, the
  routed experts their own unit over `efsdp` when ep > 1, the root = final norm + head), each
  cut by TP/EP first (`parallel/tensor_parallel.py`, `parallel/expert_parallel.py`) and then
  chunked on dim 0 by FSDP with torch.chunk semantics (ceil(S/n) rows per rank, the padded
  slice allocated on every rank). Routed experts whose expert-FSDP group is larger than the
  local experts are sharded on dim 1 instead (evenly, no padding: the sharding torchtitan uses
  and `apply_fsdp` adopts for that case);
- which parameters Muon steps (`optim/groups.py`: momentum, one fp32 state) and which AdamW
  (exp_avg and exp_avg_sq, fp32);
- the tensors each block saves for backward (`model/attention.py`, `model/moe.py`), the
  block inputs only under activation checkpointing, plus one block recomputed in backward;
- the chunked loss (`model/loss.py`): one chunk's fp32 logits at a time, and the fused path's
  fp32 head gradient computed in the forward;
- the collectives of `plan/collectives.py`'s byte rule: what this rank sends.

Sizes are bytes; `gpu` selects the GPU's numerics (bf16 compute under autocast, bf16
all-gathers, bf16 Newton-Schulz and the NCCL all-to-all for Muon's redistribution) when
`train.dtype = "bf16"`, fp32 and gloo's all-gather path otherwise (a CPU job's plan).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from trinity_train.config import Config, ModelConfig, grad_accum_for
from trinity_train.model.blocks import block_style, is_global_layer
from trinity_train.model.context_attention import halo_plan
from trinity_train.optim.groups import is_muon_param
from trinity_train.optim.muon import deal_rounds, ns_cost
from trinity_train.optim.muon_exchange import EXCHANGE_BYTES, exchange_calls
from trinity_train.parallel.assumed_routing import AssumedRouting
from trinity_train.parallel.expert_parallel import EP_WAVES, cut_runs
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.reshard_policy import gathered_numel, kept_gathered
from trinity_train.plan.collectives import (CP_CATEGORY, EP_ALL_TO_ALL, FSDP_ALL_GATHER, FSDP_ALL_REDUCE,
                                            FSDP_EMBEDDING_ROWS_GATHER, FSDP_EMBEDDING_ROWS_REDUCE, FSDP_REDUCE_SCATTER,
                                            MUON_REDISTRIBUTE)
from trinity_train.plan.trace import CATEGORIES

FP32, LONG = 4, 8


# ------------------------------------------------------------------------------ parameters


@dataclass(frozen=True)
class Param:
    """One parameter as this rank's FSDP unit sees it, after TP and EP have cut it."""

    name: str  # CONTRACT.md name (decides Muon or AdamW)
    unit: str  # the FSDP unit: "embed", "block", "experts", "root"
    shape: tuple[int, ...]  # the TP/EP-local shape FSDP shards
    global_numel: int  # elements of the whole (unsplit) parameter
    batch: int = 1  # whole matrices stacked in dim 0 (experts), for Muon


def _block_params(m: ModelConfig, moe: bool, tp: int, ep: int, experts_apart: bool) -> list[Param]:
    """A block's parameters, local to a tp (and ep) rank: column-split weights lose 1/tp of dim 0,
    row-split ones of dim 1 (`tensor_parallel.py`); routed experts 1/ep of dim 0, in their own
    FSDP unit under EP or when `experts_apart` (gathered once a step: `parallel/fsdp.py`)."""
    style = block_style(m)
    d, hd, h, kv = m.hidden_size, m.head_dim, m.num_heads, m.num_kv_heads

    def w(name, rows, cols, split):  # split: 0 column-parallel, 1 row-parallel, None replicated
        shape = (rows // tp, cols) if split == 0 else (rows, cols // tp) if split == 1 else (rows, cols)
        return Param(name, "block", shape, rows * cols)

    def v(name, size, split=False):
        return Param(name, "block", (size // tp if split else size,), size)

    out = [v("attn_norm.weight", d), w("attn.q_proj.weight", h * hd, d, 0), w("attn.k_proj.weight", kv * hd, d, 0),
           w("attn.v_proj.weight", kv * hd, d, 0), w("attn.gate_proj.weight", h * hd, d, 0),
           w("attn.o_proj.weight", d, h * hd, 1), v("attn.q_norm.weight", hd), v("attn.k_norm.weight", hd),
           v("mlp_norm.weight", d)]
    if style.post_norms:
        out += [v("attn_post_norm.weight", d), v("mlp_post_norm.weight", d)]
    if style.normformer:
        out += [v("attn.head_scale", h, split=True), v("attn_post_norm.weight", d), v("attn_post_norm.bias", d)]
    width = m.moe_intermediate_size * m.num_shared_experts if moe else m.intermediate_size
    ffn = "mlp.shared_expert" if moe else "mlp"
    if width:
        out += [w(f"{ffn}.gate_proj.weight", width, d, 0), w(f"{ffn}.up_proj.weight", width, d, 0),
                w(f"{ffn}.down_proj.weight", d, width, 1)]
        if style.normformer:
            out += [v(f"{ffn}.mid_norm.weight", width, split=True), v(f"{ffn}.mid_norm.bias", width, split=True)]
    if moe:
        e, i = m.num_experts, m.moe_intermediate_size
        out.append(w("mlp.router.gate.weight", e, d, None))
        unit = "experts" if ep > 1 or experts_apart else "block"
        for name, rows, cols in (("gate_proj", i, d), ("up_proj", i, d), ("down_proj", d, i)):
            shape = (e // ep, rows // tp, cols) if name != "down_proj" else (e // ep, rows, cols // tp)
            out.append(Param(f"mlp.experts.{name}", unit, shape, e * rows * cols, batch=e // ep))
    return out


_PARAMS_CACHE: dict[tuple[str, int, int], list[list[Param]]] = {}


def block_gathered_bytes(layers: list[list[Param]], dims: ParallelDims, a: float,
                         experts_once: bool = False) -> list[float]:
    """Each block's FSDP units (the block, its routed experts unless `experts_once`: gathered once
    a step whatever the policy) gathered on a rank, `a` bytes an element: what the reshard policy
    weighs (`model_params`' layers; `parallel/fsdp.py` `_gathered_bytes`)."""
    units = ("block",) if experts_once else ("block", "experts")
    return [sum(unsharded_numel(p, dims) for p in layer if p.unit in units) * a for layer in layers[1:-1]]


def experts_once(cfg: Config) -> bool:
    """Whether the routed experts are gathered once a step (`parallel.expert_gather = "step"`)."""
    return cfg.parallel.expert_gather == "step"


def blocks_kept_gathered(cfg: Config, block_bytes: list[float]) -> list[bool]:
    """Per block: kept gathered from its forward into its backward (parallel/reshard_policy.py)."""
    return kept_gathered(block_bytes, cfg.parallel.keep_gathered_gib)


def model_params(m: ModelConfig, tp: int, ep: int, experts_apart: bool = False) -> list[list[Param]]:
    """Every parameter of a tp/ep rank, grouped by layer: [embed], one list per block, [root]
    (`experts_apart`: the routed experts their own unit without EP too; cached: the layout search
    asks for the same few thousands of times)."""
    key = (repr(m), tp, ep, experts_apart)
    if key not in _PARAMS_CACHE:
        _PARAMS_CACHE[key] = _model_params(m, tp, ep, experts_apart)
    return _PARAMS_CACHE[key]


_KINDS_CACHE: dict[tuple[str, int, int, bool], tuple[Counter, list[tuple[Param, ...]]]] = {}


def _kinds(m: ModelConfig, tp: int, ep: int, experts_apart: bool) -> tuple[Counter, list[tuple[Param, ...]]]:
    key = (repr(m), tp, ep, experts_apart)
    if key not in _KINDS_CACHE:
        layers = model_params(m, tp, ep, experts_apart)
        _KINDS_CACHE[key] = (Counter(p for layer in layers for p in layer), list({tuple(x) for x in layers[1:-1]}))
    return _KINDS_CACHE[key]


def param_counts(m: ModelConfig, tp: int, ep: int, experts_apart: bool = False) -> Counter:
    """How many of each distinct parameter a tp/ep rank holds (cached, as `model_params`)."""
    return _kinds(m, tp, ep, experts_apart)[0]


def block_kinds(m: ModelConfig, tp: int, ep: int, experts_apart: bool = False) -> list[tuple[Param, ...]]:
    """The distinct blocks of a tp/ep rank (dense, MoE), each once (cached)."""
    return _kinds(m, tp, ep, experts_apart)[1]


def _model_params(m: ModelConfig, tp: int, ep: int, experts_apart: bool) -> list[list[Param]]:
    embed = [Param("embed.weight", "embed", (m.vocab_size // tp, m.hidden_size), m.vocab_size * m.hidden_size)]
    root = [Param("norm.weight", "root", (m.hidden_size,), m.hidden_size),
            Param("lm_head.weight", "root", (m.vocab_size // tp, m.hidden_size), m.vocab_size * m.hidden_size)]
    blocks = [_block_params(m, i >= m.num_dense_layers, tp, ep, experts_apart) for i in range(m.num_layers)]
    return [embed, *blocks, root]


def shard_numel(p: Param, dims: ParallelDims) -> int:
    """Elements this rank allocates for its FSDP shard of `p`, padding included."""
    n = dims.efsdp if p.unit == "experts" else dims.fsdp_shards
    if n == 1 or not dims.is_distributed:
        return math.prod(p.shape)
    # torch.chunk: ceil(S/n) rows, padded on every rank; experts fewer than the ranks: dim 1, even
    return gathered_numel(p.shape, n, p.unit == "experts") // n


def unsharded_numel(p: Param, dims: ParallelDims) -> int:
    """Elements of `p` once all-gathered (FSDP's padded flat buffer)."""
    n = dims.efsdp if p.unit == "experts" else dims.fsdp_shards
    return shard_numel(p, dims) * n if dims.is_distributed else math.prod(p.shape)


@dataclass(frozen=True)
class Numerics:
    """Element sizes the job computes and communicates in."""

    compute: int  # activations and gathered parameters (bf16 on GPUs under train.dtype = bf16)
    ns: int  # Newton-Schulz working precision
    ep_wire: int  # the EP all-to-alls' tokens (parallel.ep_wire_dtype)
    grad_wire: int  # the gradients FSDP reduces (parallel.reduce_wire_dtype)

    @staticmethod
    def of(cfg: Config, gpu: bool) -> Numerics:
        compute = 2 if gpu and cfg.train.dtype == "bf16" else 4
        ns = {"bf16": 2, "fp32": 4}.get(cfg.optim.muon_ns_dtype, 2 if gpu else 4)
        ep_wire = 2 if cfg.parallel.ep_wire_dtype == "bf16" else compute
        return Numerics(compute, ns, ep_wire, 2 if cfg.parallel.reduce_wire_dtype == "bf16" else FP32)

    def reduce_buffer(self, dims: ParallelDims, gpu: bool) -> int:
        """FSDP's reduce dtype (its reduce-scatter input, HSDP's partial sums): the wire's where
        FSDP's policy casts (GPUs, HSDP), fp32 where a CPU job's reduce-scatter casts what it sends
        (`parallel/fsdp.py` `mixed_precision_policy`)."""
        return self.grad_wire if gpu or dims.dp_replicate > 1 else FP32


# ------------------------------------------------------------------------------ activations


def _attention_saved(m: ModelConfig, tokens: float, tp: int, a: int, seq_len: int, layer: int,
                     batch: int, gpu: bool) -> float:
    """Bytes one attention sublayer keeps for backward, for `tokens` tokens of this tp rank's
    heads. Each RMSNorm keeps its input and its normalized output in fp32 (`F.rms_norm` on
    `x.float()`); the sigmoid gate keeps its output and the attention output, o_proj its input.
    SDPA's fused kernel keeps q, k, v, its output and the log-sum-exp, and, given a mask, the
    mask converted to the compute dtype (`model/attention.py`):
    - no mask: a causal global layer;
    - a sliding window computed in blocks: (window + block) / block copies of the keys and
      values, a [block, window + block] mask per block of queries;
    - a dense mask (a window over half the sequence or more, document masking): [T, T] per
      sequence (one for the batch without document masking).
    With a mask on GPUs the kv heads are expanded to every head (the memory-efficient kernel does
    not take grouped-query heads); CPUs' fused kernel takes them as they are."""
    window = m.sliding_window
    is_local = not is_global_layer(m, layer) and window < seq_len
    blocks = is_local and seq_len > 2 * window
    dense_mask = not blocks and (is_local or m.doc_masking)
    kv_copies, mask = 1.0, 0.0
    if blocks:
        kv_copies, mask = _window_blocks(window, a)
    elif dense_mask:
        mask = a * seq_len * (1 if m.doc_masking else 1 / batch)
    keys = _sdpa_keys(m, tp, a, gpu, masked=blocks or dense_mask) * kv_copies
    return tokens * (_attention_per_token(m, tp, a) + _sdpa_per_query(m, tp, a) + keys + mask)


def _window_blocks(window: int, a: int) -> tuple[float, float]:
    """A sliding window computed in blocks (`attention.sliding_window_blocks`): the copies of the
    keys and values per query, and the mask bytes per query ([block, window + block] a block)."""
    block = window // 2 if window % 2 == 0 else window
    return (window + block) / block, a * (window + block)


def _attention_per_token(m: ModelConfig, tp: int, a: int) -> float:
    """What an attention sublayer keeps per token outside SDPA: attn_norm and attn_post_norm
    (sequence-split under TP), q_norm and k_norm (fp32 input and output each), the normed input
    of q/k/v/gate (whole sequence under TP), and the gate's three tensors (the attention output
    reshaped, sigmoid(gate), their product that o_proj takes)."""
    d, hd = m.hidden_size, m.head_dim
    h, kv = m.num_heads // tp, m.num_kv_heads // tp
    return 2 * FP32 * (2 * d / tp + (h + kv) * hd) + a * d + a * hd * h * 3


def _sdpa_per_query(m: ModelConfig, tp: int, a: int) -> float:
    """SDPA's saved q, output and log-sum-exp, per query."""
    h = m.num_heads // tp
    return a * m.head_dim * 2 * h + FP32 * h


def _sdpa_keys(m: ModelConfig, tp: int, a: int, gpu: bool, masked: bool) -> float:
    """SDPA's saved key and value, per key (expanded to every head by a GPU's masked kernel)."""
    heads = m.num_heads // tp if gpu and masked else m.num_kv_heads // tp
    return a * m.head_dim * 2 * heads


def _context_attention_saved(cfg: Config, dims: ParallelDims, a: int, layer: int, gpu: bool) -> float:
    """An attention sublayer's saved bytes under context parallelism (`model/context_attention.py`),
    for this rank's B x T / cp tokens:
    - a global layer keeps the keys and values of the whole row (all-gathered, put in row order)
      and a [T / cp, T] mask, converted to the compute dtype (per row with document masking);
    - a sliding-window layer attends each of its two chunks of c = T / (2 cp) tokens as a row of
      its own, extended by the halo of window - 1 positions before it: SDPA's tensors over
      2B rows of L = window - 1 + c positions (the halo's query slots zero), a per-row mask
      (every extended row has document ids), blocks when L > 2 x window."""
    m, b, t, cp, tp = cfg.model, cfg.train.micro_batch_size, cfg.data.seq_len, dims.cp, dims.tp
    local = b * t / cp
    per_token = _attention_per_token(m, tp, a) * local
    if is_global_layer(m, layer) or m.sliding_window >= t:
        mask = a * local * t * (1 if m.doc_masking else 1 / b)
        return per_token + _sdpa_per_query(m, tp, a) * local + _sdpa_keys(m, tp, a, gpu, True) * b * t + mask
    window = m.sliding_window
    length = window - 1 + t // (2 * cp)  # a chunk and its halo
    if length > 2 * window:  # computed in blocks of queries, as in one process
        kv_copies, mask = _window_blocks(window, a)
    else:
        kv_copies, mask = 1.0, a * length
    extended = 2 * b * length
    return per_token + extended * (_sdpa_per_query(m, tp, a) + _sdpa_keys(m, tp, a, gpu, True) * kv_copies + mask)


def _ffn_saved(tokens: float, d: int, width: int, a: int) -> float:
    """A gated FFN's saved tensors: its input, gate and up outputs, the activation's output, and
    the product down_proj takes."""
    return tokens * (a * d + 4 * a * width)


class MoeSaved(NamedTuple):
    """What one MoE sublayer keeps for backward, by part (bytes)."""

    router: float  # fp32 logits, scores, the balance loss's normalised scores; the top-k
    sort: float  # the sort's index
    experts: float  # the routed copies this rank's experts receive (and the dispatch's permuted copy), their activations
    combine: float  # the returned copies in fp32 for the weighted sum
    shared: float  # the shared expert's


def _moe_saved_parts(m: ModelConfig, tokens: float, dims: ParallelDims, a: int, skew: float) -> MoeSaved:
    """The parts of `_moe_saved`; the routed copies a rank's experts receive are skew x the mean
    when ep > 1."""
    d, e, k = m.hidden_size, m.num_experts, m.num_experts_per_tok
    i = m.moe_intermediate_size // dims.tp
    copies = tokens * k
    received = copies * (skew if dims.ep > 1 else 1.0)
    return MoeSaved(
        router=tokens * (FP32 * (3 * e + d) + (LONG + 2 * FP32) * k),
        sort=copies * LONG * (2 if dims.ep > 1 else 1),
        experts=received * (a * d + 4 * a * i) + (received * a * d if dims.ep > 1 else 0),
        combine=copies * FP32 * d,
        shared=_ffn_saved(tokens, d, m.moe_intermediate_size * m.num_shared_experts // dims.tp, a)
        if m.num_shared_experts else 0.0)


def _moe_saved(m: ModelConfig, tokens: float, dims: ParallelDims, a: int, skew: float) -> float:
    """Bytes one MoE sublayer keeps (`MoeSaved`: the router, the sort, the experts' copies and
    activations, the combine, the shared expert)."""
    return sum(_moe_saved_parts(m, tokens, dims, a, skew))


def recomputed_in_expert_unit(cfg: Config, dims: ParallelDims, a: int, skew: float) -> float:
    """Of a checkpointed MoE block recomputed in its backward, what its routed experts' own FSDP
    unit (under EP, or gathered once a step) creates and keeps:
    the call that dispatches the tokens, runs the experts and the shared expert beside them and
    combines (`model/moe.py`), with the routed result as it returns and unpermuted. The memory
    tracker (torch's FSDPMemTracker) files what an FSDP unit's forward creates during backward
    as activations (a recomputation) and the rest of the recomputed block as temporaries."""
    parts = _moe_saved_parts(cfg.model, local_tokens(cfg, dims), dims, a, skew)
    returned = 2 * local_tokens(cfg, dims) * cfg.model.num_experts_per_tok * a * cfg.model.hidden_size
    return parts.experts + parts.shared + parts.combine + returned


def block_activation_bytes(cfg: Config, dims: ParallelDims, layer: int, a: int, skew: float, gpu: bool) -> float:
    """Everything block `layer` keeps for backward for one micro-batch on this rank (`gpu`: the
    kernels a GPU runs)."""
    m = cfg.model
    tokens = local_tokens(cfg, dims)
    saved = (_context_attention_saved(cfg, dims, a, layer, gpu) if dims.cp > 1 else
             _attention_saved(m, tokens, dims.tp, a, cfg.data.seq_len, layer, cfg.train.micro_batch_size, gpu))
    saved += tokens * 2 * FP32 * 2 * m.hidden_size / dims.tp  # mlp_norm, mlp_post_norm: input, normalized
    if layer >= m.num_dense_layers:
        return saved + _moe_saved(m, tokens, dims, a, skew)
    return saved + _ffn_saved(tokens, m.hidden_size, m.intermediate_size // dims.tp, a)


def shared_activation_bytes(cfg: Config, dims: ParallelDims, a: int) -> float:
    """What every layer shares and the whole backward keeps: the rotary tables and the masks
    (under context parallelism: the global layers' [T / cp, T], the sliding-window layers' over
    2B extended chunks of L = window - 1 + T / (2 cp) positions: [L, L] each, or a [block,
    window + block] block per block of queries when they are computed in blocks, L > 2 x window)."""
    m, b, t, cp = cfg.model, cfg.train.micro_batch_size, cfg.data.seq_len, dims.cp
    out = 2 * b * t / cp * m.head_dim * a * (1 + (0 if m.block != "gemma3" else 1))  # cos, sin
    if cp > 1:
        window = m.sliding_window
        length = window - 1 + t // (2 * cp)
        keys_per_query = _window_blocks(window, 1)[1] if length > 2 * window else length  # bool: 1 byte a key
        return out + (b if m.doc_masking else 1) * t / cp * t + 2 * b * length * keys_per_query
    if m.doc_masking or m.sliding_window < t:
        out += (b if m.doc_masking else 1) * t * t  # a bool mask per layer kind
    return out


def local_tokens(cfg: Config, dims: ParallelDims) -> int:
    """Tokens of one micro-batch on this rank: its rows, and its 1/cp of each under context parallelism."""
    return cfg.train.micro_batch_size * cfg.data.seq_len // dims.cp


def model_level_activation_bytes(cfg: Config, dims: ParallelDims, a: int) -> float:
    """What the model keeps once per forward: the shared tables and masks, the final norm's
    input, and the fused loss's gradients (hidden and the head's fp32 weight gradient,
    computed in the forward)."""
    m = cfg.model
    tokens = local_tokens(cfg, dims)
    out = shared_activation_bytes(cfg, dims, a) + tokens * FP32 * m.hidden_size / dims.tp  # final norm input
    if dims.tp == 1:  # the fused loss: grad_hidden and the head's fp32 weight gradient
        out += tokens * a * m.hidden_size + FP32 * m.vocab_size * m.hidden_size
    return out


def loss_chunk_bytes(cfg: Config, dims: ParallelDims, a: int) -> float:
    """One loss chunk's transient tensors. Fused (no TP): its fp32 logits (the gradient is built
    in place in them) with their cast back to the compute dtype, and, in a compute dtype
    narrower than fp32, the head-gradient product and its fp32 copy (`model/loss.py`)."""
    m = cfg.model
    rows = min(m.loss_chunk_tokens, local_tokens(cfg, dims))
    if dims.tp > 1:
        # The vocabulary-split head (ColwiseParallel, output Replicate) all-gathers each chunk's
        # logits: its local slices, the gathered [rows, vocab] and cross entropy's fp32 work.
        return rows * m.vocab_size * (2 * FP32 + a)
    if a == FP32:
        return rows * m.vocab_size * FP32
    return rows * m.vocab_size * (FP32 + a) + m.vocab_size * m.hidden_size * (a + FP32)


# ------------------------------------------------------------------------------ memory


class BlockBytes(NamedTuple):
    """One block's bytes that the backward moments add up (0 for FSDP's buffers in one process)."""

    gathered: float  # its FSDP units gathered, in the compute dtype (= its unsharded gradients)
    experts: float  # of which its routed experts' unit (0 when they are in the block's unit)
    grad_shards: float  # its fp32 gradient shards
    prefetched: float  # the all-gather buffer of the unit the backward gathers first (the experts under EP)
    reducing: float  # the fp32 reduce-scatter buffer of the unit it reduce-scatters last (the block's own)


@dataclass
class MemoryModel:
    """Predicted bytes per category (`trace.CATEGORIES`) at the step's peak, and at the three
    moments that compete for it."""

    by_category: dict[str, float]
    moment: str  # "end of forward", "backward of block N" or "optimizer step"
    moments: dict[str, dict[str, float]] = field(repr=False, default_factory=dict)

    @property
    def peak(self) -> float:
        return sum(self.by_category.values())


def memory_per_rank(cfg: Config, dims: ParallelDims, *, gpu: bool,
                    routing: AssumedRouting = AssumedRouting(), steady: bool = True) -> MemoryModel:
    """Peak memory of one rank (the traced rank: the hottest experts under `routing`) at the
    larger of three moments: the end of the last micro-batch's forward (its last loss chunk),
    the backward of the block where the most is alive, and the optimizer step.

    `steady`: a step after the first, whose optimizer state exists through forward and backward;
    False models the first iteration, which the trace runs (the state is born in its step)."""
    m, nums = cfg.model, Numerics.of(cfg, gpu)
    a = nums.compute
    once = experts_once(cfg)
    layers = model_params(m, dims.tp, dims.ep, once)
    counts = param_counts(m, dims.tp, dims.ep, once)
    muon = cfg.optim.name == "muon"
    # Equal parameters of equal layers counted once, times how many there are (the search's speed).
    shard = [(p, shard_numel(p, dims) * count) for p, count in counts.items()]
    grads = FP32 * sum(n for _, n in shard)
    params = grads + FP32 * 2 * m.num_experts * (m.num_layers - m.num_dense_layers)  # + expert_bias, bias_momentum
    opt = FP32 * sum(n * (1 if muon and is_muon_param(p.name, cfg.optim.muon_router) else 2)
                     for p, n in shard)
    static = {"parameters": params, "optimizer state": opt if steady else 0.0}

    distributed = dims.is_distributed
    ac = cfg.train.activation_checkpointing
    accum = grad_accum_for(cfg.train, dims.dp)
    # Earlier micro-batches' gradients are kept; under HSDP they are FSDP's partial-reduce buffers
    # until the last micro-batch all-reduces them into .grad: the tracker files them as temporaries.
    # Reduced after the last micro-batch only (parallel.sync_every_micro_batch = false), each unit
    # keeps its whole (unsharded) fp32 gradients instead.
    # Gathered once a step (parallel.expert_gather = "step"), the routed experts keep their unsharded
    # gradients instead, summed in FSDP's reduce dtype until the last micro-batch reduces them.
    kept_grads = grads if accum > 1 else 0.0
    partial = dims.dp_replicate > 1
    summed = 0.0  # unsharded gradients FSDP sums over the micro-batches (reduced after the last)
    if accum > 1 and distributed and not cfg.parallel.sync_every_micro_batch:
        summed = nums.reduce_buffer(dims, gpu) * sum(unsharded_numel(p, dims) * count for p, count in counts.items())
        kept_grads, partial = 0.0, False
    elif accum > 1 and distributed and once:
        routed = [(p, count) for p, count in counts.items() if p.unit == "experts"]
        kept_grads -= FP32 * sum(shard_numel(p, dims) * count for p, count in routed)
        summed = nums.reduce_buffer(dims, gpu) * sum(unsharded_numel(p, dims) * count for p, count in routed)
    # FSDP sums them in the parameter's own .grad where its reduce dtype is the compute dtype, else
    # in a buffer of its own (fp32 beside bf16 compute), which the memory tracker cannot name: a
    # temporary.
    in_grad = nums.reduce_buffer(dims, gpu) == a
    kept = {"gradients": (0.0 if partial else kept_grads) + (summed if in_grad else 0.0),
            "temporaries": (kept_grads * nums.reduce_buffer(dims, gpu) / FP32 if partial else 0.0)
            + (0.0 if in_grad else summed)}

    def unit_bytes(layer, unit_names=("block", "experts")):
        """A layer's FSDP units (the block, and its experts under EP) gathered, in the compute dtype."""
        return sum(unsharded_numel(p, dims) for p in layer if p.unit in unit_names) * a if distributed else 0.0

    # Per block, dense or MoE (equal blocks computed once): `BlockBytes`.
    kinds = {}
    for moe in {i >= m.num_dense_layers for i in range(m.num_layers)}:
        layer = layers[1 + (m.num_dense_layers if moe else 0)]
        own, experts = unit_bytes(layer, ("block",)), unit_bytes(layer, ("experts",))
        kinds[moe] = BlockBytes(gathered=own + experts, experts=experts,
                                grad_shards=FP32 * sum(shard_numel(p, dims) for p in layer),
                                prefetched=own if once else max(own, experts),
                                reducing=own * nums.reduce_buffer(dims, gpu) / a)
    block = [kinds[i >= m.num_dense_layers] for i in range(m.num_layers)]
    # Each block's routed experts held gathered through the step (gathered once a step), and the
    # rest of its units, which the reshard policy decides on.
    held = [b.experts if once else 0.0 for b in block]
    own = [b.gathered - h for b, h in zip(block, held)]
    root = unit_bytes(layers[-1], ("root",))
    root_grads = FP32 * sum(shard_numel(p, dims) for p in layers[-1])

    tokens = local_tokens(cfg, dims)
    per_block = [block_activation_bytes(cfg, dims, i, a, routing.skew, gpu) for i in range(m.num_layers)]
    block_input = tokens * a * m.hidden_size / dims.tp  # what a checkpointed block keeps

    # The end of forward: every block's activations (or inputs, checkpointed) kept, the loss's
    # last chunk alive, the root and the blocks the reshard policy keeps gathered (the others
    # resharded; under checkpointing the last block's all-gather buffer still held).
    forward_acts = m.num_layers * block_input if ac else sum(per_block)
    # The blocks the reshard policy keeps gathered from their forward to their backward (the last
    # one, those within parallel.keep_gathered_gib, or all: parallel/reshard_policy.py).
    staying = (blocks_kept_gathered(cfg, own) if distributed else [False] * len(block))
    forward = {**static, **kept, "gathered parameters": root + sum(o for o, s in zip(own, staying) if s) + sum(held),
               "activations": forward_acts + model_level_activation_bytes(cfg, dims, a) + loss_chunk_bytes(cfg, dims, a),
               "communication buffers": max(own) if distributed and ac else 0.0}

    # The backward of block i (last to first): blocks 0..i's activations kept (checkpointed: their
    # inputs, block i recomputed); the root and block i gathered, block i's unsharded gradients
    # computed, the next block's all-gather prefetched, block i+1's reduce-scatter buffer held
    # (fp32) and the blocks above it reduce-scattered into their shards; the head's gradient
    # waits for the root's reduce-scatter at the very end.
    head = a * m.vocab_size // dims.tp * m.hidden_size  # unsharded, in the compute dtype
    # A CPU job's reduce-scatter left travelling (without HSDP: parallel/gloo) holds what it
    # receives beside its input until the next one is issued.
    in_flight = 2 if (not gpu and dims.dp_replicate == 1) else 1
    # There the root's reduce-scatter starts when its gradients are final, before the last block's
    # backward (`reduce_root_at_its_last_gradient`; with one micro-batch a step: a later one adds
    # to the first's gradients and does not overlap): the root resharded, the head's gradient
    # reduced into its shard, its buffers in flight through the last block's backward.
    early_root = distributed and in_flight == 2 and accum == 1
    root_reducing = root * nums.reduce_buffer(dims, gpu) / a if early_root else 0.0
    shared = shared_activation_bytes(cfg, dims, a)
    # In a checkpointed MoE block's backward, what its experts' own unit recomputed is filed as
    # activations, the rest of the recomputed block as temporaries (`recomputed_in_expert_unit`).
    inside = recomputed_in_expert_unit(cfg, dims, a, routing.skew) if ac and distributed and (dims.ep > 1 or once) else 0.0
    backward, later_grads, below = {}, 0.0, sum(per_block)
    for i in reversed(range(m.num_layers)):
        below -= per_block[i]
        acts = (i + 1) * block_input if ac else below + per_block[i]
        if distributed:  # block i's unsharded gradients are as large as its gathered parameters
            grads_now = kept_grads if accum > 1 else later_grads + (root_grads if early_root else 0.0)
            temps = (0.0 if early_root else head) + block[i].gathered + (per_block[i] if ac else 0.0)
            prefetched = block[i - 1].prefetched if i and not staying[i - 1] else 0.0
            reducing = block[i + 1].reducing if i + 1 < m.num_layers else root_reducing
            comm = prefetched + reducing * in_flight
            gathered = (0.0 if early_root else root) + block[i].gathered + sum(
                o for o, s in zip(own[:i], staying) if s) + sum(held[:i])  # and the kept ones below it
        else:  # one process: gradients land in .grad directly, the head's in the loss's backward
            grads_now = kept_grads if accum > 1 else later_grads + root_grads + block[i].grad_shards
            temps, comm, gathered = per_block[i] if ac else 0.0, 0.0, 0.0
        unit = inside if i >= m.num_dense_layers else 0.0
        candidate = {**static, "gathered parameters": gathered,
                     "gradients": (0.0 if partial else grads_now) + (summed if in_grad else 0.0),
                     "activations": acts + shared + unit, "communication buffers": comm,
                     "temporaries": temps - unit + (kept_grads if partial else 0.0) + (0.0 if in_grad else summed)}
        if not backward or sum(candidate.values()) > sum(backward[1].values()):
            backward = (f"backward of block {i}", candidate)
        later_grads += block[i].grad_shards

    step = {"parameters": params, "gathered parameters": 0.0, "gradients": grads,
            "optimizer state": opt, "activations": 0.0, "communication buffers": 0.0,
            "temporaries": muon_temporaries(cfg, dims, counts, nums) if muon else 0.0}
    moments = {"end of forward": forward, "backward": backward[1], "optimizer step": step}
    moment = max(moments, key=lambda k: sum(moments[k].values()))
    name = backward[0] if moment == "backward" else moment
    return MemoryModel({c: moments[moment].get(c, 0.0) for c in CATEGORIES}, name, moments)


def _gather_factors(p: Param, dims: ParallelDims) -> tuple[int, ...]:
    """The sizes (> 1) of the mesh dims over which Muon must assemble one of `p`'s matrices: the
    dims that split a matrix dimension or replicate it (`optim/muon.py`, `_Layout`); HSDP's
    replica groups each run the whole step, so dp_replicate is never one of them."""
    if not dims.is_distributed:
        return ()
    tp = dims.tp if (dims.tp > 1 and p.unit in ("block", "experts") and "router" not in p.name) else 1
    if p.unit == "experts":
        # ep and dim-0 expert-FSDP split whole experts (no gathering); dim-1 sharding does not.
        fsdp = dims.efsdp if dims.efsdp > p.shape[0] else 1
    elif p.batch > 1:  # experts inside their block's unit: FSDP's dim 0 is the expert dim
        fsdp = 1
    else:
        fsdp = dims.fsdp_shards
    return tuple(f for f in (fsdp, tp) if f > 1)


def _gather_group(p: Param, dims: ParallelDims) -> int:
    return math.prod(_gather_factors(p, dims))


def _packed(p: Param, dims: ParallelDims) -> bool:
    """Whether Muon exchanges `p`'s matrices by packed all-to-alls (`optim/muon_exchange.py`): a
    gather group of one mesh dim (FSDP's dim-0 shard over TP's is a `_StridedShard`, two dims)."""
    return len(_gather_factors(p, dims)) == 1


def muon_temporaries(cfg: Config, dims: ParallelDims, params: Counter, nums: Numerics) -> float:
    """Muon's working set for its largest matrix: the round's stack of n updates, the matrix
    whole on its owner, and Newton-Schulz's iterate, Gram matrix and polynomial."""
    worst, packed = 0.0, Counter()
    for p, count in params.items():
        if not is_muon_param(p.name, cfg.optim.muon_router):
            continue
        rows, cols = p.shape[-2:]
        # The matrix (or this rank's expert stack) whole, as Newton-Schulz sees it.
        whole = math.prod(p.shape) * dims.tp if p.batch > 1 else p.global_numel
        small = min(rows, cols)
        n = _gather_group(p, dims)
        ns = nums.ns * (3 * whole + 3 * max(1, p.batch) * small * small)
        update = FP32 * shard_numel(p, dims)  # the Nesterov update before its cast
        if n > 1 and _packed(p, dims):
            packed[p.unit == "experts"] += nums.ns * shard_numel(p, dims) * count
            worst = max(worst, ns + update)
            continue
        stack = nums.ns * whole * (2 if n > 1 else 0)  # the stacked round and its redistribution
        worst = max(worst, stack + ns + update)
    # A packed exchange holds two buffers of a chunk at once: the received pieces and the results,
    # the results and their way back, or that and what comes back (`optim/muon_exchange.py`).
    chunk = max((min(b, EXCHANGE_BYTES) for b in packed.values()), default=0.0)
    return worst + 2 * chunk


# ------------------------------------------------------------------------------ traffic


@dataclass(frozen=True)
class Flow:
    """Bytes one rank sends per step in one kind of collective over one group."""

    category: str  # as plan/collectives.py names the issuer
    kind: str  # all_gather, reduce_scatter, all_to_all, all_reduce
    dim: str  # the mesh dimension(s) of the group
    group_size: int
    calls: int
    sent: float


def traffic_per_rank(cfg: Config, dims: ParallelDims, *, gpu: bool,
                     routing: AssumedRouting = AssumedRouting()) -> list[Flow]:
    """What one rank sends per optimizer step, by collective (see the module doc)."""
    if not dims.is_distributed:
        return []
    m, nums = cfg.model, Numerics.of(cfg, gpu)
    a = nums.compute
    accum = grad_accum_for(cfg.train, dims.dp)
    experts_apart = experts_once(cfg)
    layers = model_params(m, dims.tp, dims.ep, experts_apart)
    flows: list[Flow] = []
    # Gathered once a micro-batch, not again in its backward: the embedding (whose backward does not read its
    # weight: `parallel/fsdp.py`), the root (never resharded) and the blocks the reshard policy
    # keeps gathered (parallel/reshard_policy.py).
    once = [True, *blocks_kept_gathered(cfg, block_gathered_bytes(layers, dims, a, experts_apart)), True]
    for unit, n, dim in (("dense", dims.fsdp_shards, dims.fsdp_dim), ("experts", dims.efsdp, "efsdp")):
        if n == 1 and dims.dp_replicate == 1:
            continue
        names = ("experts",) if unit == "experts" else ("embed", "block", "root")
        units = [(i, tuple(p for p in layer if p.unit in names)) for i, layer in enumerate(layers)]
        units = [(i, u) for i, u in units if u]
        kinds = Counter(u for _, u in units)  # equal units counted once, times their number
        shard_of = {u: sum(shard_numel(p, dims) for p in u) for u in kinds}
        shards = [shard_of[u] * c for u, c in kinds.items()]
        # The routed experts gathered once a step are gathered and reduced once, whatever the accumulation.
        step_once = unit == "experts" and experts_apart
        passes = 1 if step_once else accum
        gathers = sum(1 if once[i] or step_once else 2 for i, _ in units) * passes
        ag = sum(shard_of[u] * (1 if once[i] or step_once else 2) for i, u in units) * a * (n - 1) * passes
        # fp32 (or bf16) gradients, (n-1)/n of the n-shard input: every micro-batch, or the last only
        reductions = accum if cfg.parallel.sync_every_micro_batch and not step_once else 1
        rs = sum(shards) * nums.grad_wire * (n - 1) * reductions
        # A CPU job's embedding gathers the rows its forward reads (parallel/gloo/embedding_all_gather.py)
        # and sends the rows its tokens touched (parallel/gloo/embedding_reduce_scatter.py): data-dependent, so
        # their own categories, counted as the whole table (an upper bound).
        rows = unit == "dense" and not gpu and dims.tp == 1
        table = sum(s for u, s in zip(kinds, shards) if u[0].unit == "embed") * (n - 1) if rows else 0.0
        if not units:
            continue
        if n > 1:  # (experts outside expert FSDP are not sharded, but still all-reduced under HSDP)
            flows += [Flow(FSDP_ALL_GATHER, "all_gather", dim, n, gathers - int(rows) * accum,
                           ag - table * a * accum),
                      Flow(FSDP_REDUCE_SCATTER, "reduce_scatter", dim, n, (len(units) - int(rows)) * reductions,
                           rs - table * nums.grad_wire * reductions)]
            if rows:
                flows += [Flow(FSDP_EMBEDDING_ROWS_GATHER, "all_gather", dim, n, accum, table * a * accum),
                          Flow(FSDP_EMBEDDING_ROWS_REDUCE, "reduce_scatter", dim, n, reductions,
                               table * nums.grad_wire * reductions)]
        if dims.dp_replicate > 1:  # HSDP: the shards' gradients, all-reduced over the replicas once a step
            r = dims.dp_replicate
            flows.append(Flow(FSDP_ALL_REDUCE, "all_reduce", "dp_replicate", r, len(units),
                              sum(shards) * nums.grad_wire * 2 * (r - 1) / r))
    moe_layers = m.num_layers - m.num_dense_layers
    if dims.ep > 1 and moe_layers:
        tokens = local_tokens(cfg, dims)
        out_of_rank = tokens * m.num_experts_per_tok * (dims.ep - 1) / dims.ep * m.hidden_size * nums.ep_wire
        per_layer = 2 * out_of_rank * (1 + routing.skew)  # dispatch and combine, forward and backward
        forwards = 2 if cfg.train.activation_checkpointing else 1  # the recomputation dispatches again
        waves = len(cut_runs(m.num_experts // dims.ep, EP_WAVES))  # each wave its own calls
        calls = 2 * (forwards + 1) * waves * moe_layers * accum
        sent = (per_layer + (forwards - 1) * out_of_rank * (1 + routing.skew)) * moe_layers * accum
        flows.append(Flow(EP_ALL_TO_ALL, "all_to_all", "ep", dims.ep, calls, sent))
    if dims.cp > 1:
        flows += _context_flows(cfg, dims, a, accum)
    if cfg.optim.name == "muon":
        flows += _muon_flows(cfg, dims, param_counts(m, dims.tp, dims.ep, experts_apart), nums, gpu)
    dp = dims.dp * dims.cp  # every rank holding other tokens
    if dp > 1:  # token count, loss totals, tokens per expert
        small = (LONG + 3 * FP32 + FP32 * moe_layers * m.num_experts) * 2 * (dp - 1) / dp
        flows.append(Flow("other: all_reduce", "all_reduce", "dp_cp" if dims.cp > 1 else "dp", dp, 3, small))
    return flows


def _context_flows(cfg: Config, dims: ParallelDims, a: int, accum: int) -> list[Flow]:
    """Context parallelism's exchanges of keys and values (`model/context_attention.py`), each
    micro-batch, again in an activation-checkpointed block's recomputation:
    - a global layer all-gathers its T / cp tokens' keys and values ((cp - 1) copies sent) and
      reduce-scatters their gradients in backward ((cp - 1) / cp of the whole row's);
    - a sliding-window layer sends the halo rows its neighbours need (the window - 1 positions
      before each of their chunks that this rank holds) and takes their gradients back in backward,
      one all-to-all each way: rank 0's rows (`halo_plan`), the traced rank's;
    - the MoE losses' per-sequence statistics, summed over the group."""
    m, b, t, cp = cfg.model, cfg.train.micro_batch_size, cfg.data.seq_len, dims.cp
    kv_row = b * (m.num_kv_heads // dims.tp) * 2 * m.head_dim * a  # one position's keys and values, every row
    forwards = 2 if cfg.train.activation_checkpointing else 1
    gathered = sum(1 for i in range(m.num_layers) if is_global_layer(m, i) or m.sliding_window >= t)
    windowed = m.num_layers - gathered
    flows = []
    if gathered:
        flows += [Flow(CP_CATEGORY["all_gather"], "all_gather", "cp", cp, gathered * forwards * accum,
                       t / cp * kv_row * (cp - 1) * gathered * forwards * accum),
                  Flow(CP_CATEGORY["reduce_scatter"], "reduce_scatter", "cp", cp, gathered * accum,
                       t * kv_row * (cp - 1) / cp * gathered * accum)]
    if windowed:
        plan = halo_plan(t, cp, 0, m.sliding_window)
        out_rows = sum(plan.input_splits) - plan.input_splits[0]
        back_rows = sum(plan.output_splits) - plan.output_splits[0]
        flows.append(Flow(CP_CATEGORY["all_to_all"], "all_to_all", "cp", cp, windowed * (forwards + 1) * accum,
                          (out_rows * forwards + back_rows) * kv_row * windowed * accum))
    # The MoE losses' per-sequence sums (balance loss: scores and counts per expert; z-loss: a sum
    # and a count), one all-reduce a forward and one in backward.
    moe_layers = m.num_layers - m.num_dense_layers
    sums = (2 * moe_layers * b * m.num_experts if m.aux_loss_alpha > 0 else 0) + (2 if m.z_loss_weight > 0 else 0)
    if sums and moe_layers:
        passes = (forwards + 1) * accum
        flows.append(Flow(CP_CATEGORY["all_reduce"], "all_reduce", "cp", cp, passes, passes * FP32 * sums * 2 * (cp - 1) / cp))
    return flows


def _muon_flows(cfg: Config, dims: ParallelDims, params: Counter, nums: Numerics, gpu: bool) -> list[Flow]:
    """Muon's exchanges, dealt as `optim/muon.py` deals them: matrices of one layout and shape go
    to owners (`deal_rounds`, largest shapes first, each to the least-loaded rank of its gather
    group of n).

    - Packed (a gather group of one mesh dim, `optim/muon_exchange.py`): each rank sends its piece
      of every matrix it does not own, and each owner every other rank's slice of its result: on
      average 2(n-1)/n pieces a matrix, in two all-to-alls per wave of each chunk of `EXCHANGE_BYTES`
      (`exchange_calls`).
    - Rounds (the other layouts): a round stacks n slots of this rank's shard of one matrix, sends
      the stack to the owners and takes the results back. On GPUs DTensor sends each as an
      all-to-all ((n-1)/n of the stack each way); on a CPU mesh as an all-gather of the stack and a
      chunk (the stack x (n-1) out, an all-gather back).
    """
    buckets: dict[tuple, tuple[Param, int]] = {}  # (mesh, shape, n) -> (a member, how many), in model order
    for p, count in params.items():
        if is_muon_param(p.name, cfg.optim.muon_router):
            key = ("experts" if p.unit == "experts" else "dense", p.shape, _gather_group(p, dims), _packed(p, dims))
            buckets[key] = (p, buckets.get(key, (p, 0))[1] + count)
    loads: dict[tuple[str, int], list[int]] = {}
    pieces: dict[tuple[str, int], list[float]] = {}  # a packed exchange's pieces, by global size
    calls, sent, packed_sent = 0, 0.0, 0.0
    for key in sorted(buckets, key=lambda k: -ns_cost(k[1])):  # stable: ties keep the model's order
        mesh, shape, n, packed = key
        if n == 1:
            continue
        member, count = buckets[key]
        rounds = len(deal_rounds(count, ns_cost(shape), loads.setdefault((mesh, n), [0] * n)))
        piece = shard_numel(member, dims) * nums.ns  # this rank's piece of one matrix
        if packed:
            pieces.setdefault((mesh, n), []).extend([member.global_numel * nums.ns / n] * count)
            packed_sent += count * piece * 2 * (n - 1) / n
            continue
        calls += 2 * rounds
        sent += rounds * 2 * n * piece * ((n - 1) / n if gpu else (n - 1))
    flows = []
    if calls:
        flows.append(Flow(MUON_REDISTRIBUTE, "all_to_all" if gpu else "all_gather", "fsdp", dims.fsdp_shards,
                          calls, sent))
    if pieces:
        flows.append(Flow(MUON_REDISTRIBUTE, "all_to_all", "fsdp", dims.fsdp_shards,
                          sum(exchange_calls(p) for p in pieces.values()), packed_sent))
    return flows


def communicators(dims: ParallelDims) -> int:
    """NCCL communicators a rank uses (distinct groups of more than one rank): FSDP, TP, EP,
    expert FSDP, the data-parallel group, the replicas, the flattened FSDP x TP group of the
    gradient norm, and under context parallelism the cp group and the dp x cp group of the loss
    sums."""
    groups = {(dims.fsdp_dim, dims.fsdp_shards), ("tp", dims.tp), ("ep", dims.ep), ("efsdp", dims.efsdp),
              ("dp", dims.dp), ("dp_replicate", dims.dp_replicate), ("dp_shard_tp", dims.fsdp_shards * dims.tp),
              ("cp", dims.cp), ("dp_cp", dims.dp * dims.cp if dims.cp > 1 and dims.dp > 1 else 1)}
    sizes = {}
    for name, size in groups:
        if size > 1:
            sizes.setdefault((size, name if name != "dp" or dims.dp_replicate > 1 else "dp_shard"), 1)
    return len(sizes)


__all__ = ["CATEGORIES", "Flow", "MemoryModel", "Numerics", "Param", "communicators",
           "memory_per_rank", "model_params", "shard_numel", "traffic_per_rank"]
