"""Predicted step time: compute at a stated MFU, communication priced per link class.

Compute is `training_flops_per_token` (model/counting.py) x the tokens a rank trains per step /
(peak x MFU). Activation checkpointing runs every block's forward again in backward: the block
matmuls cost 8/6 of their training FLOPs (the head's do not).

A collective goes at NVLink speed when every rank of its group sits in one node, else at the
NIC's: the world's rank order is (dp_replicate, dp_shard, cp, tp) with tp innermost, so rank r lives
on node r // gpus_per_node, and a dim's groups stay inside nodes when the block of neighbouring
ranks they tile divides the node (`parallel.node_layout`, the rule training checks). The time is bytes sent / link rate (the bytes already follow the ring
algorithms of `plan/collectives.py`). Two bounds are reported: no overlap (compute + comm) and
full overlap (max of the two); a real step lies between.

`price_measured` prices a job whose compute was measured (a CPU/gloo run: the 2-host bed's
one-host step) and whose links are slow. Each collective's credited bytes are what gloo puts on
the wire (benchmarks/multinode.py's calibration: 1.00-1.01 per kind; FSDP's reduce-scatter is an
all-to-all there, `parallel/gloo/reduce_scatter.py`, since gloo's own sends 2x).
"""

from __future__ import annotations

from dataclasses import dataclass

from trinity_train.config import Config, grad_accum_for
from trinity_train.model.counting import training_flops_per_token
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

    @property
    def no_overlap_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def overlap_s(self) -> float:
        return max(self.compute_s, self.comm_s)

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


def split_by_link(flows: list[Flow], dims: ParallelDims, gpus_per_node: int) -> tuple[float, float]:
    """(bytes inside a node, bytes across nodes) this rank sends per step."""
    intra = sum(f.sent for f in flows if within_nodes(f.dim, dims, gpus_per_node))
    return intra, sum(f.sent for f in flows) - intra


def step_time(cfg: Config, dims: ParallelDims, flows: list[Flow], hardware: Hardware,
              gpus_per_node: int = 8, mfu: float = DEFAULT_MFU) -> StepTime:
    """The predicted step of one rank on `hardware` (see the module doc)."""
    intra, inter = split_by_link(flows, dims, gpus_per_node)
    return step_time_of_bytes(cfg, dims, intra, inter, hardware, mfu)


def step_time_of_bytes(cfg: Config, dims: ParallelDims, intra_bytes: float, inter_bytes: float,
                       hardware: Hardware, mfu: float = DEFAULT_MFU) -> StepTime:
    """The predicted step of one rank that sends `intra_bytes` inside its node and `inter_bytes`
    across nodes per step (a trace's split, or `split_by_link`'s of the formula's flows)."""
    comm = intra_bytes / hardware.intra_bytes_s + inter_bytes / hardware.inter_bytes_s
    return StepTime(compute_seconds(cfg, dims, hardware, mfu), comm, intra_bytes, inter_bytes,
                    tokens_per_rank(cfg, dims) / dims.tp)


def price_measured(flows: list[Flow], compute_s: float, link_gbits_s: float) -> StepTime:
    """A job whose compute time was measured (`compute_s`, a one-host step) and whose every
    collective crosses one link of `link_gbits_s` (the 2-host bed: 1 Gbit/s)."""
    wire = sum(f.sent for f in flows)
    return StepTime(compute_s, wire / (link_gbits_s * 1e9 / 8), 0.0, wire, 0.0)
