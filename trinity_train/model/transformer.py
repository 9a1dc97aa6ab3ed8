"""TrinityModel: embedding (* sqrt(d)), decoder blocks, final norm, untied head, and its init.

Labels are aligned with the inputs: `labels[b, t]` is the token that position t should predict
(the data loader shifts them), and -100 marks positions that do not count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from trinity_train.config import ModelConfig, init_std
from trinity_train.errors import ConfigError
from trinity_train.model.attention import (Attention, AttentionMask, build_attention_mask,
                                           positions_from_documents, rotary_cos_sin,
                                           sliding_window_blocks)
from trinity_train.model.blocks import TransformerBlock, block_style, make_rms_norm
from trinity_train.model.context_attention import SequenceShard, context_attention_mask
from trinity_train.model.loss import IGNORE_INDEX, chunked_cross_entropy, cross_entropy_by_group
from trinity_train.model.moe import MoE, MoEAux, balance_loss, expert_alignment_problem, update_expert_bias
from trinity_train.model.norms import LayerNorm, RMSNorm


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [B, T, V] only when no labels were given
    ce_sum: torch.Tensor  # fp32 scalar: summed cross entropy over counted labels
    num_tokens: torch.Tensor  # long scalar: counted labels
    aux_loss: torch.Tensor  # fp32 scalar: alpha-weighted sequence-wise aux loss, summed over layers
    z_loss: torch.Tensor  # fp32 scalar: weighted router z-loss, summed over layers, token mean
    tokens_per_expert: torch.Tensor  # fp32 [num_moe_layers, E], detached
    # fp64 [3, num_groups] (summed CE, counted labels, argmax matches) by the forward's
    # `token_groups`; None without them (training)
    group_totals: torch.Tensor | None = None


def layer_attention_mask(seq_len: int, window: int | None, document_ids: torch.Tensor | None,
                         batch: int, device: torch.device) -> AttentionMask:
    """The mask shared by the layers of one kind: sliding-window blocks when the window is shorter
    than half the sequence (only then do blocks skip work), else a dense mask or plain causal."""
    if window is not None and seq_len > 2 * window:
        return sliding_window_blocks(seq_len, window, document_ids, batch, device)
    return build_attention_mask(seq_len, window, document_ids, device)


class TrinityModel(nn.Module):
    # The loss may compute the head's gradients in its forward (model/loss.py); a parallel plan
    # whose head cannot be used as a plain weight (tensor parallelism) turns this off.
    fused_loss: bool = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.num_layers))
        self.norm = make_rms_norm(block_style(cfg), cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.layers if layer.is_moe]

    @torch.no_grad()
    def init_weights(self) -> None:
        """Draw every parameter (DESIGN §3). Deterministic under `torch.manual_seed`, and usable
        after `to_empty()` from the meta device."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, LayerNorm, Attention, MoE)):
                module.reset_parameters()  # gains, head scales, expert-bias buffers
        std = init_std(self.cfg)
        for param in self.parameters():
            if param.ndim >= 2:  # every matrix: embedding, projections, experts, router, head
                nn.init.trunc_normal_(param, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, token_groups: torch.Tensor | None = None,
                num_groups: int = 0, context: SequenceShard | None = None) -> ModelOutput:
        """`token_groups` [B, T] (evaluation, no grad, with `labels`): each token's group in
        [0, num_groups), for totals by group (`loss.cross_entropy_by_group`) in `group_totals`.
        `context`: this rank's part of rows split over a context-parallel group (the inputs, labels,
        positions and document ids are then this rank's tokens only, the positions given)."""
        cfg = self.cfg
        batch, seq_len = input_ids.shape
        device = input_ids.device
        documents = document_ids if cfg.doc_masking else None
        if position_ids is None:
            position_ids = (positions_from_documents(documents) if documents is not None
                            else torch.arange(seq_len, device=device)[None])

        h = self.embed(input_ids) * math.sqrt(cfg.hidden_size)

        # Built once per forward and shared by every layer of the same kind.
        kinds = {layer.is_global for layer in self.layers}
        if context is None:
            masks = {is_global: layer_attention_mask(seq_len, None if is_global else cfg.sliding_window,
                                                     documents, batch, device) for is_global in kinds}
        else:
            masks = {is_global: context_attention_mask(context, None if is_global else cfg.sliding_window, batch,
                                                       layer_attention_mask) for is_global in kinds}
        rotary = {theta: rotary_cos_sin(position_ids, cfg.head_dim, theta, h.dtype)
                  for theta in {layer.rope_theta for layer in self.layers} if theta is not None}

        moe_aux = []
        for layer in self.layers:
            h, aux = layer(h, masks[layer.is_global], rotary.get(layer.rope_theta))
            if aux is not None:
                moe_aux.append(aux)
        h = self.norm(h)

        zero = torch.zeros((), dtype=torch.float32, device=device)
        group_totals = None
        if token_groups is not None:
            if labels is None or torch.is_grad_enabled():
                raise ValueError("token_groups are for evaluation: pass labels and run under torch.no_grad()")
            logits = None
            ce_sum, num_tokens, group_totals = cross_entropy_by_group(
                h.reshape(-1, cfg.hidden_size), labels.reshape(-1), self.lm_head, cfg.loss_chunk_tokens,
                token_groups.reshape(-1), num_groups)
        elif labels is None:
            logits = self.lm_head(h)
            ce_sum, num_tokens = zero, torch.zeros((), dtype=torch.long, device=device)
        else:
            logits = None
            ce_sum, num_tokens = chunked_cross_entropy(h.reshape(-1, cfg.hidden_size),
                                                       labels.reshape(-1), self.lm_head,
                                                       cfg.loss_chunk_tokens, fused=self.fused_loss)

        aux_loss, z_loss = self._router_losses(moe_aux, labels, context, zero)
        tokens_per_expert = (torch.stack([a.tokens_per_expert for a in moe_aux]) if moe_aux
                             else torch.zeros(0, cfg.num_experts, device=device))
        return ModelOutput(logits, ce_sum, num_tokens, aux_loss, z_loss, tokens_per_expert, group_totals)

    def _router_losses(self, moe_aux: list[MoEAux], labels: torch.Tensor | None, context: SequenceShard | None,
                       zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux loss, z-loss) of the micro-batch. Under context parallelism both are functions of
        sums over each row's tokens, which lie on every rank of the group: the per-sequence
        balance statistics and the z-loss's sum and count are summed over it (one all-reduce,
        whose backward sums the gradients back), so every rank of the group holds the whole
        micro-batch's values (the step weighs them by 1/cp)."""
        cfg = self.cfg
        aux_on, z_on = cfg.aux_loss_alpha > 0 and bool(moe_aux), cfg.z_loss_weight > 0 and bool(moe_aux)
        aux_loss = sum((a.aux_loss for a in moe_aux), zero)
        z_sums = None
        if z_on:
            router_z = sum(a.router_z for a in moe_aux)  # [B, T]
            counted = (labels != IGNORE_INDEX) if labels is not None else torch.ones_like(router_z, dtype=torch.bool)
            z_sums = torch.stack([(router_z * counted).sum(), counted.sum().float()])
        if context is not None and (aux_on or z_on):
            balance = torch.stack([a.balance for a in moe_aux]) if aux_on else zero.new_zeros(0)  # [layers, 2, B, E]
            summed = context.exchange.all_reduce(torch.cat([balance.flatten()] + ([z_sums] if z_on else [])))
            balance, z_sums = summed[:balance.numel()].view_as(balance), summed[balance.numel():]
            aux_loss = sum((balance_loss(b, context.seq_len, cfg.num_experts_per_tok, cfg.aux_loss_alpha)
                            for b in balance), zero)
        z_loss = cfg.z_loss_weight * z_sums[0] / z_sums[1].clamp_min(1) if z_on else zero
        return aux_loss, z_loss

    def update_expert_biases(self, counts: torch.Tensor) -> None:
        """Apply the configured load-balancing rule once, from counts [num_moe_layers, E] summed
        over the optimizer step's micro-batches (and ranks)."""
        layers = self.moe_layers
        expected = (len(layers), self.cfg.num_experts)
        if tuple(counts.shape) != expected:
            raise ValueError(f"update_expert_biases: counts must have shape {expected} "
                             f"(MoE layers, experts), got {tuple(counts.shape)}")
        cfg = self.cfg
        for moe, layer_counts in zip(layers, counts):
            update_expert_bias(moe.expert_bias, moe.bias_momentum, layer_counts, cfg.load_balance,
                               gamma=cfg.bias_update_rate, smebu_lambda=cfg.smebu_lambda,
                               smebu_beta=cfg.smebu_beta, smebu_kappa=cfg.smebu_kappa)


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu") -> TrinityModel:
    """Build on `device` and initialise; on "meta" nothing is allocated or drawn (materialise with
    `to_empty` and call `init_weights` after parallelising)."""
    problem = expert_alignment_problem(cfg)
    if problem is not None:
        raise ConfigError(problem)
    # Constructed on meta so that no default initialisation is drawn and thrown away; the values
    # depend only on the RNG state when `init_weights` runs.
    with torch.device("meta"):
        model = TrinityModel(cfg)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        model.init_weights()
    return model
