"""One optimizer step and one validation pass (DESIGN §2): what `Trainer` runs every iteration.

`TrainingStep` has two parts. `forward_backward`: forward + backward over the micro-batches, each
scaled so the summed gradient is that of the token-weighted mean cross entropy of the whole global
batch (plus aux and z losses) -> global loss, pre-clip gradient norm and tokens per expert
(`StepTotals`). `apply`: `StepGuard` verdict (apply or skip) -> clip, optimizer step, expert-bias
update from the step's tokens per expert, scheduler step (and the LR back-off after a rollback).
Fault drills act through the `StepFaults` hooks (`stability.drills`), no-ops without drills.

Every place where a distributed run must combine values across data-parallel ranks goes through
`parallel.reductions` with the run's `ParallelDims` (marked "DP all-reduce": over the data- and
context-parallel ranks, every rank holding other tokens); in one process the
dims have no mesh and the sums are the identity, so one code path serves one and N ranks. Each
rank's loss is its share of the global token-weighted mean, so the data-parallel gradient
reduction must SUM rank gradients, not average them (FSDP2: `set_gradient_divide_factor(1.0)`).
FSDP reduces each micro-batch's gradients (HSDP all-reduces only the last's), or with
`parallel.sync_every_micro_batch = false` only the last micro-batch's backward reduces the sum;
with `parallel.expert_gather = "step"` the routed experts stay gathered through the step and
only the last backward reduces theirs (`parallel.fsdp.gather_experts_once`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trinity_train import signals
from trinity_train.config import Config, position_bucket_starts
from trinity_train.model.attention import positions_from_documents
from trinity_train.model.loss import GROUP_CE, GROUP_TOKENS, IGNORE_INDEX
from trinity_train.observe.layer_stats import LayerStatsCollector, per_layer_grad_norms
from trinity_train.parallel.context_parallel import sequence_shard, shard_micro_batch
from trinity_train.parallel.fsdp import (all_reduce_across_replicas, expert_units, gather_experts_once,
                                         reduce_gradients)
from trinity_train.parallel.gloo.communication import GlooCommunication
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.reductions import (clip_grads_with_norm_, global_grad_norm, start_sum_over_data_parallel,
                                              sum_over_data_parallel)
from trinity_train.stability import StepGuard, Verdict
from trinity_train.stability.drills import StepFaults
from trinity_train.stability.rollback import LRBackoff


def autocast_context(cfg: Config, device: torch.device):
    if cfg.train.dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass
class StepResult:
    loss: float  # mean cross entropy over the step's counted tokens, all ranks
    aux_loss: float
    z_loss: float
    grad_norm: float  # global, before clipping
    tokens: int  # counted (label) tokens, all ranks
    tokens_per_expert: torch.Tensor  # [num_moe_layers, E], summed over micro-batches and ranks
    lrs: dict[str, float]  # learning rate of each group kind for this step
    lr_scale: float  # the LR back-off factor in those rates (1 outside a back-off)
    verdict: Verdict
    layer_grad_norms: dict[str, list[float]] | None = None  # a skipped step's, for its incident report
    layer_stats: dict | None = None  # the `layers` record (without iter/step) on statistics iterations
    signals: dict[str, float] = field(default_factory=dict)  # the guard's signals' values, by name


def micro_batches(batch: Any, micro_batch_size: int, dims: ParallelDims | None = None,
                  doc_masking: bool = False) -> list[dict[str, torch.Tensor]]:
    """Split the rank's rows of a global batch into micro-batches of model inputs. Context
    parallelism splits the sequence here: with `dims.cp > 1` each micro-batch keeps this rank's
    share of every row (`parallel.context_parallel.shard_micro_batch`; `doc_masking`: the model's)."""
    fields = ("input_ids", "labels", "position_ids", "document_ids")
    tensors = {f: getattr(batch, f) for f in fields if getattr(batch, f, None) is not None}
    rows = tensors["input_ids"].shape[0]
    parts = [{f: t[start:start + micro_batch_size] for f, t in tensors.items()}
             for start in range(0, rows, micro_batch_size)]
    if dims is not None and dims.cp > 1:
        parts = [shard_micro_batch(mb, dims.cp, dims.cp_rank, doc_masking) for mb in parts]
    return parts


def forward_micro_batch(model: nn.Module, mb: dict[str, torch.Tensor], cfg: Config, device: torch.device,
                        dims: ParallelDims, **extra):
    """The model's forward on one micro-batch (moved to `device`), given this rank's
    `SequenceShard` under context parallelism; `extra`: the model's evaluation arguments."""
    mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
    context = sequence_shard(mb, dims)
    with autocast_context(cfg, device):
        return model(mb["input_ids"], labels=mb["labels"], position_ids=mb.get("position_ids"),
                     document_ids=mb.get("document_ids"), **({"context": context} if context else {}), **extra)


@dataclass
class StepTotals:
    """What `TrainingStep.forward_backward` measured, global over ranks: the verdict and the
    apply part read it (and the guard's signals, `signals.SIGNALS`, are read from it)."""

    loss: float  # mean cross entropy over the step's counted tokens
    aux_loss: float
    z_loss: float
    tokens: int  # counted (label) tokens
    tokens_per_expert: torch.Tensor  # [num_moe_layers, E], summed over micro-batches and ranks
    grad_norm: float  # before clipping
    grad_norm_tensor: torch.Tensor  # the same, as the clipping takes it
    layer_stats: dict | None  # the `layers` record (without iter/step) on statistics iterations


class TrainingStep:
    """Forward/backward over micro-batches (`forward_backward`, the part that context parallelism
    or communication overlap replace or wrap), then the stability verdict and the optimizer step
    (`apply`)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, guard: StepGuard,
                 cfg: Config, device: torch.device, dims: ParallelDims | None = None,
                 lr_backoff: LRBackoff | None = None, faults: StepFaults | None = None,
                 communication: GlooCommunication | None = None):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.guard = guard
        self.cfg = cfg
        self.device = device
        self.dims = dims or ParallelDims.one_process()
        self.lr_backoff = lr_backoff or LRBackoff()
        self.faults = faults if faults is not None else StepFaults()  # the drills' hooks; no-ops without
        # The units held gathered through the step (parallel.expert_gather = "step"), found once.
        self.experts_held = expert_units(model) if cfg.parallel.expert_gather == "step" else []
        # A CPU job's overlapped collectives (parallel/gloo); no-ops elsewhere.
        self.communication = communication or GlooCommunication()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.layer_stats = LayerStatsCollector(model, cfg.metrics.layer_stats_every, self.dims)

    def learning_rates(self) -> dict[str, float]:
        lrs: dict[str, float] = {}
        for group in self.optimizer.param_groups:
            lrs.setdefault(group.get("kind", "adamw"), float(group["lr"]))
        return lrs

    def __call__(self, batch: Any, iteration: int, steps_applied: int) -> StepResult:
        """Train on `batch` as iteration `iteration`, after `steps_applied` optimizer steps."""
        parts = micro_batches(batch, self.cfg.train.micro_batch_size, self.dims, self.cfg.model.doc_masking)
        totals = self.forward_backward(parts, iteration)
        return self.apply(totals, iteration, steps_applied)

    def forward_backward(self, parts: list[dict[str, torch.Tensor]], iteration: int) -> StepTotals:
        """Forward and backward over this rank's micro-batches `parts`, leaving the summed
        gradient of the global batch's token-weighted mean loss in the parameters; returns the
        step's global totals (loss, token and expert counts, pre-clip gradient norm, and the
        layer statistics where due)."""
        stats_due = self.layer_stats.due(iteration)
        tokens, totals, counts = self.accumulate_gradients(parts, iteration, stats_due)
        ce_sum, aux_loss, z_loss = totals.tolist()
        num_tokens = int(tokens.item())
        grad_norm = global_grad_norm(self.params)  # global over ranks and shards
        layer_stats = self.layer_stats.collect(counts) if stats_due else None  # pre-clip gradients
        return StepTotals(ce_sum / max(num_tokens, 1), aux_loss, z_loss, num_tokens, counts, grad_norm.item(),
                          grad_norm, layer_stats)

    def accumulate_gradients(self, parts: list[dict[str, torch.Tensor]], iteration: int, stats_due: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tensor work of `forward_backward`, with no host sync (a planner runs it on fake
        tensors): (global counted tokens, global [cross-entropy sum, aux loss, z loss], global
        tokens per expert)."""
        # The token-weighted mean needs the global token count before the first backward, not
        # before the first forward: its DP all-reduce travels while the forward computes.
        tokens = sum((mb["labels"] != IGNORE_INDEX).sum() for mb in parts).to(self.device)
        counting = start_sum_over_data_parallel(tokens, self.dims)
        # Aux and z losses are means per micro-batch: average them over micro-batches and ranks
        # (the cp ranks of a row each hold its micro-batch's whole value: model._router_losses).
        per_part = 1.0 / (len(parts) * self.dims.dp * self.dims.cp)

        totals = torch.zeros(3, device=self.device)  # cross-entropy sum, aux loss, z loss
        counts = None
        for i, mb in enumerate(parts):
            last = i == len(parts) - 1
            sync_every = self.cfg.parallel.sync_every_micro_batch
            if not sync_every:
                reduce_gradients(self.model, now=last)
            elif self.dims.dp_replicate > 1:
                all_reduce_across_replicas(self.model, now=last)
            gather_experts_once(self.experts_held, last_micro_batch=last)
            # The reduced shards start out empty only in the first backward that reduces.
            self.communication.before_backward(fresh=i == 0 if sync_every else last)
            with self.layer_stats.recording(stats_due):  # the forward only: not recomputations in backward
                out = forward_micro_batch(self.model, mb, self.cfg, self.device, self.dims)
            ce_sum = self.faults.scale_loss(out.ce_sum, iteration)
            if counting is not None:
                counting.wait()
                counting = None
            loss = ce_sum / tokens.clamp_min(1) + (out.aux_loss + out.z_loss) * per_part
            loss.backward()
            self.communication.after_backward()
            totals += torch.stack([ce_sum.detach().float(), out.aux_loss.detach().float() * per_part,
                                   out.z_loss.detach().float() * per_part])
            counts = out.tokens_per_expert if counts is None else counts + out.tokens_per_expert
        self.faults.scale_grads(self.params, iteration)
        totals = sum_over_data_parallel(totals, self.dims)  # DP all-reduce
        counts = sum_over_data_parallel(counts, self.dims)  # DP all-reduce
        return tokens, totals, counts

    def update(self, grad_norm: torch.Tensor, tokens_per_expert: torch.Tensor) -> None:
        """An applied step's parameter update: clip by the pre-clip norm, the optimizer step,
        the expert-bias update, the scheduler step."""
        if self.cfg.train.grad_clip > 0:
            clip_grads_with_norm_(self.params, self.cfg.train.grad_clip, grad_norm)
        self.optimizer.step()  # (a CPU job's prefetch of the next forward runs inside it: parallel/gloo)
        self.model.update_expert_biases(tokens_per_expert)
        self.scheduler.step()

    def apply(self, totals: StepTotals, iteration: int, steps_applied: int) -> StepResult:
        """The guard's verdict on `totals`, then (if it applies the step) clipping, the optimizer
        step, the expert-bias update, the scheduler step and the LR back-off; the gradients are
        cleared either way."""
        lr_drilled = self.faults.scale_lr(self.optimizer, iteration)
        lrs = self.learning_rates()
        values = signals.measured(totals)
        verdict = self.guard.judge_signals(values, iteration, steps_applied, totals.tokens_per_expert)
        layer_stats = totals.layer_stats
        layer_grad_norms = None  # a skipped step's, for its incident report
        if not verdict.apply and layer_stats is not None:
            layer_grad_norms = {"attn": layer_stats["grad_norm_attn"], "ffn": layer_stats["grad_norm_ffn"]}
        elif not verdict.apply:  # every rank has the same verdict, so all of them join the norms' collectives
            layer_grad_norms = per_layer_grad_norms(self.model, self.dims)
        if verdict.apply:
            self.update(totals.grad_norm_tensor, totals.tokens_per_expert)
            self.lr_backoff.apply(self.optimizer, self.scheduler.get_last_lr(), steps_applied + 1)
        elif lr_drilled:  # not applied: the step's own rates again
            self.lr_backoff.apply(self.optimizer, self.scheduler.get_last_lr(), steps_applied)
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(totals.loss, totals.aux_loss, totals.z_loss, totals.grad_norm, totals.tokens,
                          totals.tokens_per_expert, lrs, self.lr_backoff.factor(steps_applied), verdict,
                          layer_grad_norms, layer_stats, values)


@dataclass
class Validation:
    """What `evaluate` measured, global over ranks."""

    loss: float  # mean cross entropy over the counted tokens
    tokens: int  # counted (label) tokens
    position_starts: list[int]  # the first position of each bucket (`config.position_bucket_starts`)
    loss_by_position: list[float | None]  # mean cross entropy of each bucket's tokens (None: no token)
    tokens_by_position: list[int]


def token_positions(mb: dict[str, torch.Tensor], doc_masking: bool) -> torch.Tensor:
    """Each token's position for the loss by position: its position in its document with
    document masking, else in the row. The micro-batch's `position_ids` when it has them (the
    loader's say exactly this, and context parallelism splits them with the tokens, so each
    rank's tokens keep their global positions)."""
    if mb.get("position_ids") is not None:
        return mb["position_ids"]
    if doc_masking and mb.get("document_ids") is not None:
        return positions_from_documents(mb["document_ids"])
    return torch.arange(mb["input_ids"].shape[-1]).expand_as(mb["input_ids"])


def position_buckets(positions: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """The bucket of each position: the index of the last start at or below it."""
    return torch.bucketize(positions.contiguous(), starts, right=True) - 1


@torch.no_grad()
def evaluate(model: nn.Module, val_loader: Any, cfg: Config, device: torch.device,
             dims: ParallelDims | None = None) -> Validation:
    """Mean cross entropy over the first `eval.batches` validation batches (all ranks), and
    by position bucket (`eval.position_buckets`, from the loss's own chunks)."""
    dims = dims or ParallelDims.one_process()
    model.eval()
    starts = position_bucket_starts(cfg.eval, cfg.data.seq_len)
    starts_tensor = torch.tensor(starts)
    # cross-entropy sum, tokens, then each bucket's cross-entropy sum, then each bucket's tokens
    totals = torch.zeros(2 + 2 * len(starts), dtype=torch.float64, device=device)
    for batch in val_loader.batches(cfg.eval.batches):
        for mb in micro_batches(batch, cfg.train.micro_batch_size, dims, cfg.model.doc_masking):
            buckets = position_buckets(token_positions(mb, cfg.model.doc_masking), starts_tensor)
            out = forward_micro_batch(model, mb, cfg, device, dims, token_groups=buckets.to(device),
                                      num_groups=len(starts))
            totals += torch.cat([torch.stack([out.ce_sum.double(), out.num_tokens.double()]),
                                 out.group_totals[GROUP_CE], out.group_totals[GROUP_TOKENS]])
    model.train()
    totals = sum_over_data_parallel(totals, dims).tolist()  # DP all-reduce
    ce_sum, tokens = totals[:2]
    bucket_ce, bucket_tokens = totals[2:2 + len(starts)], totals[2 + len(starts):]
    return Validation(ce_sum / max(tokens, 1.0), int(tokens), starts,
                      [ce / n if n else None for ce, n in zip(bucket_ce, bucket_tokens)],
                      [int(n) for n in bucket_tokens])
