"""Predicted step time: compute at a stated MFU, communication priced per link class.

Compute is `training_flops_per_token` (model/counting.py) x the tokens a rank trains per step /
(peak x MFU). Activation checkpointing runs every block's forward again in backward: the block
matmuls cost 8/6 of their training FLOPs (the head's do not).

A collective goes at NVLink speed when every rank of its group sits in one node, else at the
NIC's: the world's rank order is (dp_replicate, dp_shard, cp, tp) with tp innermost, so rank r lives
on node r // gpus_per_node, and a dim's groups stay inside nodes when the block of neighbouring
ranks they tile divides the node (`parallel.node_layout`, the rule training checks). A datasheet
GPU (`hardware.Hardware`) prices a collective at bytes sent / link rate (the bytes already follow
the ring algorithms of `plan/collectives.py`); a calibrated profile (`profile.ProfiledHardware`)
by the seconds measured for its kind, link class and size per call. Two bounds are reported: no
overlap (compute + comm) and full overlap (max of the two); a real step lies between. The
*predicted* step is the full-overlap bound where the backend overlaps collectives with compute
(NCCL: datasheet GPUs and NCCL profiles) and the no-overlap bound where it does not (a gloo
profile's CPU job).

Exposed time (layouts with `parallel.allow_ep_tp_across_nodes`, `plan --search --across-nodes`):
a tp, cp or ep collective sits on the critical path of its layer (the next matmul needs its
result), which NVLink makes short but the slow link does not. So the seconds of tp, cp and ep
flows whose groups span nodes are *exposed*: the full-overlap step is max(compute, the other
communication) + exposed. The one overlap the code has there is the EP exchange's waves
(`parallel/expert_parallel.py`, `EP_WAVES`): wave w+1's tokens travel while wave w's experts
compute, so of an across-node EP all-to-all split into W waves, (W-1)/W of its time hides behind
the routed experts' compute (at most that compute's time) and the rest (the first wave's
dispatch, the last wave's combine) is exposed. A layout whose tp, cp and ep groups stay inside
nodes has nothing exposed: its step is priced as above.

With a profile the compute is measured too: its `step_flops` is the rate a training step of the
config's model reached on the job's own ranks and layout, so `compute_seconds` at the profile's
MFU (step / matmul rate) is the model's FLOPs over that rate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trinity_train.config import Config, grad_accum_for
from trinity_train.model.counting import training_flops_per_token
from trinity_train.parallel.expert_parallel import EP_WAVES, cut_runs
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.node_layout import within_nodes
from trinity_train.plan.formula import Flow
from trinity_train.plan.hardware import DEFAULT_MFU, Hardware


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_s: float
    intra_bytes: float  # bytes this rank sends inside its node per step
    inter_bytes: float  # ... and across nodes
    tokens_per_gpu: float  # the job's tokens per step / its GPUs (a tp group shares its ranks' tokens)
    exposed_s: float = 0.0  # the part of comm_s nothing overlaps (across-node tp/cp/ep; module doc)
    overlaps: bool = True  # whether the backend overlaps collectives with compute (the predicted bound)

    @property
    def no_overlap_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def overlap_s(self) -> float:
        return max(self.compute_s, self.comm_s - self.exposed_s) + self.exposed_s

    @property
    def predicted_s(self) -> float:
        """The step the plan predicts: the bound the backend's overlap gives (module doc)."""
        return self.overlap_s if self.overlaps else self.no_overlap_s

    @property
    def rank_key(self) -> tuple[float, float]:
        """How the search orders steps: the predicted bound, then the other one."""
        return (self.overlap_s, self.no_overlap_s) if self.overlaps else (self.no_overlap_s, self.overlap_s)

    def tokens_per_s_per_gpu(self, overlap: bool = True) -> float:
        return self.tokens_per_gpu / (self.overlap_s if overlap else self.no_overlap_s)


def tokens_per_rank(cfg: Config, dims: ParallelDims) -> float:
    """Tokens one rank trains per step: its micro-batches' (the tp ranks of a group train the same
    ones; the cp ranks of a group 1/cp of each row)."""
    return cfg.train.micro_batch_size * grad_accum_for(cfg.train, dims.dp) * cfg.data.seq_len / dims.cp


def flops_per_gpu(cfg: Config, dims: ParallelDims) -> float:
    """FLOPs one GPU computes per step (model/counting.py's training FLOPs of its tokens, the
    recomputed forward of activation checkpointing included); a tp rank does 1/tp of its group's."""
    m = cfg.model
    per_token = training_flops_per_token(m, cfg.data.seq_len)
    if cfg.train.activation_checkpointing:
        head = 6 * m.vocab_size * m.hidden_size  # the head is outside the checkpointed blocks
        blocks = per_token - head
        per_token = head + blocks * 8 / 6  # one more forward (2 of the 6 FLOPs per multiply-add)
    return per_token * tokens_per_rank(cfg, dims) / dims.tp


def compute_seconds(cfg: Config, dims: ParallelDims, hardware: Hardware, mfu: float = DEFAULT_MFU) -> float:
    """`flops_per_gpu` / (peak x MFU)."""
    return flops_per_gpu(cfg, dims) / (hardware.peak_tflops * 1e12 * mfu)


def routed_expert_seconds(cfg: Config, dims: ParallelDims, hardware: Hardware, mfu: float = DEFAULT_MFU) -> float:
    """The part of `compute_seconds` the routed experts take (gate, up and down matmuls of each
    token's top-k experts in every MoE layer; recomputed once more under activation checkpointing):
    what the EP waves can hide an exchange behind."""
    m = cfg.model
    per_token = 6 * 3 * m.hidden_size * m.moe_intermediate_size * m.num_experts_per_tok
    per_token *= (m.num_layers - m.num_dense_layers) * (8 / 6 if cfg.train.activation_checkpointing else 1)
    return per_token * tokens_per_rank(cfg, dims) / dims.tp / (hardware.peak_tflops * 1e12 * mfu)


# The mesh dims whose collectives block the next matmul (exposed when their groups span nodes).
LAYER_DIMS = ("tp", "cp", "ep")


def exposed_seconds(cfg: Config, dims: ParallelDims, flows: list[Flow], hardware: Hardware,
                    gpus_per_node: int, mfu: float = DEFAULT_MFU) -> float:
    """Seconds of tp, cp and ep collectives across nodes that nothing overlaps (the module doc's
    rule: an EP exchange's waves hide all but 1/W of it behind the routed experts' compute)."""
    across = [f for f in flows if f.dim in LAYER_DIMS and not within_nodes(f.dim, dims, gpus_per_node)]
    exposed = sum(_seconds(f, False, hardware) for f in across if f.dim != "ep")
    ep_s = sum(_seconds(f, False, hardware) for f in across if f.dim == "ep")
    if ep_s:
        waves = len(cut_runs(cfg.model.num_experts // dims.ep, EP_WAVES))
        hidden = min(ep_s * (waves - 1) / waves, routed_expert_seconds(cfg, dims, hardware, mfu))
        exposed += ep_s - hidden
    return exposed


def _seconds(flow: Flow, inside: bool, hardware: Hardware) -> float:
    return hardware.flow_seconds(flow.category, flow.kind, inside, flow.sent, flow.calls)


def split_by_link(flows: list[Flow], dims: ParallelDims, gpus_per_node: int) -> tuple[float, float]:
    """(bytes inside a node, bytes across nodes) this rank sends per step."""
    intra = sum(f.sent for f in flows if within_nodes(f.dim, dims, gpus_per_node))
    return intra, sum(f.sent for f in flows) - intra


def placed(flows: list[Flow], dims: ParallelDims, gpus_per_node: int) -> list[tuple[Flow, bool]]:
    """Each flow with whether its groups stay inside a node."""
    return [(f, within_nodes(f.dim, dims, gpus_per_node)) for f in flows]


def bottleneck(flows: list[Flow], dims: ParallelDims, time: StepTime, hardware: Hardware, gpus_per_node: int) -> str:
    """What bounds the step: "compute-bound" when the step with full overlap is its compute (the
    communication takes no longer and none of it is exposed), else the link whose collectives take
    longer and its largest flow there, e.g. "bound by across nodes: FSDP all-gather over efsdp"."""
    if time.overlap_s <= time.compute_s:
        return "compute-bound"
    on = placed(flows, dims, gpus_per_node)
    across_s = sum(_seconds(f, inside, hardware) for f, inside in on if not inside)
    inside_s = sum(_seconds(f, inside, hardware) for f, inside in on if inside)
    across = across_s >= inside_s
    top = max((f for f, inside in on if inside != across), key=lambda f: f.sent)
    return f"bound by {'across nodes' if across else 'inside nodes'}: {top.category} over {top.dim}"


def step_time(cfg: Config, dims: ParallelDims, flows: list[Flow], hardware: Hardware,
              gpus_per_node: int = 8, mfu: float = DEFAULT_MFU) -> StepTime:
    """The predicted step of one rank on `hardware` (see the module doc)."""
    timing = step_time_of_flows(cfg, dims, placed(flows, dims, gpus_per_node), hardware, mfu)
    exposed = exposed_seconds(cfg, dims, flows, hardware, gpus_per_node, mfu)
    return dataclasses.replace(timing, exposed_s=exposed) if exposed else timing


def step_time_of_flows(cfg: Config, dims: ParallelDims, flows: list[tuple[Flow, bool]], hardware: Hardware,
                       mfu: float = DEFAULT_MFU) -> StepTime:
    """The predicted step of one rank that sends `flows` per step, each with whether its group
    stays inside a node (the formula's flows placed by `placed`, or a trace's calls)."""
    comm = sum(_seconds(f, inside, hardware) for f, inside in flows)
    intra = sum(f.sent for f, inside in flows if inside)
    inter = sum(f.sent for f, inside in flows if not inside)
    return StepTime(compute_seconds(cfg, dims, hardware, mfu), comm, intra, inter, tokens_per_rank(cfg, dims) / dims.tp,
                    overlaps=hardware.overlaps_communication)
