"""The GPUs a plan prices a job on, and the memory a rank cannot give to training.

Each GPU is four datasheet numbers: memory, dense bf16 tensor-core peak, NVLink bandwidth per GPU
in one direction, and the inter-node NIC rate per GPU. A plan divides the model's FLOPs by the
peak (at a stated MFU, `timing.py`) and a collective's bytes by the link its group crosses, so
these are the only numbers it needs; a GPU not in the table is given as custom values, as the
CLI's `--gpu-memory GiB --peak-tflops T --intra-gbps B --inter-gbps B` spell them.

The reserve is what a process holds besides its tensors: the CUDA context, NCCL's buffers (one
set per communicator it uses) and the caching allocator's fragmentation. They are stated
assumptions, not measurements: a plan fits a layout only if its tensors' peak plus this reserve
is below the GPU's memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from trinity_train.parallel.node_layout import Nodes

GIB = 2 ** 30


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: int  # usable HBM per GPU
    peak_tflops: float  # dense bf16 tensor-core peak per GPU (no 2:4 sparsity)
    intra_gbytes_s: float  # NVLink per GPU, one direction, GB/s (10^9 bytes)
    inter_gbits_s: float  # NIC per GPU across nodes, Gbit/s

    @property
    def intra_bytes_s(self) -> float:
        return self.intra_gbytes_s * 1e9

    @property
    def inter_bytes_s(self) -> float:
        return self.inter_gbits_s * 1e9 / 8

    # A datasheet GPU's collectives run beside its compute (NCCL's own streams): the plan's
    # predicted step is the full-overlap bound (a profile of a gloo job says otherwise: profile.py).
    overlaps_communication = True

    def flow_seconds(self, category: str, kind: str, inside: bool, sent: float, calls: int) -> float:
        """Seconds of `calls` collectives of `kind` that send `sent` bytes from this rank in all,
        over NVLink (`inside` a node) or the NIC: the datasheet rate, whatever the kind and size
        (a calibrated profile prices each by its measured curve: `profile.ProfiledHardware`)."""
        return sent / (self.intra_bytes_s if inside else self.inter_bytes_s)


# Datasheet values (NVIDIA product pages and HGX platform specs; "with sparsity" figures halved).
GPUS: dict[str, Hardware] = {
    # H100 SXM5: 80 GB HBM3; BF16 1,979 TFLOPS with sparsity -> 989 dense; NVLink 4 900 GB/s
    # bidirectional -> 450 one way; ConnectX-7 InfiniBand NDR 400 Gbit/s per GPU (DGX H100).
    "h100": Hardware("h100", 80 * 10 ** 9, 989.0, 450.0, 400.0),
    # H200 SXM: 141 GB HBM3e, the H100's compute and NVLink; NDR 400 Gbit/s per GPU (HGX H200).
    "h200": Hardware("h200", 141 * 10 ** 9, 989.0, 450.0, 400.0),
    # B200 (HGX B200): 180 GB HBM3e per GPU (1.44 TB / 8); FP16/BF16 36 PFLOPS sparse per 8 GPUs
    # -> 2,250 dense each; NVLink 5 1.8 TB/s bidirectional -> 900 one way; 400 Gbit/s ConnectX-7.
    "b200": Hardware("b200", 180 * 10 ** 9, 2250.0, 900.0, 400.0),
    # B300 (HGX B300, Blackwell Ultra): 288 GB HBM3e; BF16 as B200 (2,250 dense); NVLink 5;
    # ConnectX-8 SuperNIC 800 Gbit/s per GPU.
    "b300": Hardware("b300", 288 * 10 ** 9, 2250.0, 900.0, 800.0),
}


DEFAULT_GPU = "h200"  # what `trinity-train plan` prices a job on without --gpu
# The node a plan places its ranks on without --gpus-per-node or parallel.ranks_per_node.
DEFAULT_NODES = Nodes(8, "the plan's default 8 GPUs per node; --gpus-per-node")
DEFAULT_MFU = 0.40  # a stated assumption: well-tuned MoE pretraining reaches 0.3-0.5 on H100s


def custom_hardware(memory_gib: float, peak_tflops: float, intra_gbytes_s: float,
                    inter_gbits_s: float, name: str = "custom") -> Hardware:
    """A GPU given by its numbers (`--gpu-memory GiB --peak-tflops T --intra-gbps B
    --inter-gbps B`): memory in GiB, NVLink in GB/s one way, the NIC in Gbit/s."""
    for label, value in (("--gpu-memory", memory_gib), ("--peak-tflops", peak_tflops),
                         ("--intra-gbps", intra_gbytes_s), ("--inter-gbps", inter_gbits_s)):
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{label} must be a finite number > 0, got {value!r}")
    return Hardware(name, int(memory_gib * GIB), float(peak_tflops), float(intra_gbytes_s),
                    float(inter_gbits_s))


def hardware_named(name: str) -> Hardware:
    """A GPU of the table by its name (h100, h200, b200, b300), any case."""
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}: one of {', '.join(GPUS)}, or give --gpu-memory, "
                         f"--peak-tflops, --intra-gbps and --inter-gbps") from None


@dataclass(frozen=True)
class Reserve:
    """Memory a training process holds besides the tensors a trace or the formula counts.

    - CUDA context: ~0.5 GiB per process with lazy module loading on CUDA 12 (the kernels of
      torch, cuBLAS and NCCL).
    - NCCL: per communicator, NCCL_BUFFSIZE (4 MiB by default) per channel and direction; we
      assume 8 channels and 2 directions (send, receive): 64 MiB per communicator a rank uses.
    - Allocator headroom: the caching allocator's fragmentation, a stated fraction (5 %) of the
      tensors' peak.
    """

    cuda_context_bytes: int = 512 * 2 ** 20
    nccl_bytes_per_communicator: int = 4 * 2 ** 20 * 8 * 2
    allocator_fraction: float = 0.05

    def lines(self, tensor_peak: float, communicators: int) -> dict[str, float]:
        """The reserve lines (bytes) for a rank whose tensors peak at `tensor_peak` and that
        uses `communicators` NCCL communicators (a line this reserve does not hold is left out)."""
        lines = {"CUDA context": (self.cuda_context_bytes, float(self.cuda_context_bytes)),
                 "NCCL buffers": (self.nccl_bytes_per_communicator, float(self.nccl_bytes_per_communicator * communicators)),
                 "allocator headroom": (self.allocator_fraction, self.allocator_fraction * tensor_peak)}
        return {name: value for name, (rate, value) in lines.items() if rate}

    def total(self, tensor_peak: float, communicators: int) -> float:
        return sum(self.lines(tensor_peak, communicators).values())


DEFAULT_RESERVE = Reserve()
CPU_RESERVE = Reserve(0, 0, 0.0)  # a CPU job's ranks (a gloo profile): their tensors are what they hold
# A GPU profile's memory is what was free with the calibrating process's CUDA context already made.
PROFILE_RESERVE = Reserve(cuda_context_bytes=0)
