"""Device and cluster specs: peak compute, memory, links; GPU presets and calibrated CPU profiles.

A device is described by
    peak        dense matmul FLOP/s in the training precision (bf16 on GPUs, fp32 on CPU)
    efficiency  achievable fractions and costs (`efficiency.py`): the same fitted constants for
                every GPU, so generations differ only by the datasheet numbers here
    HBM         memory bandwidth, which prices the memory-bound element-wise work
    links       intra-node and inter-node (bandwidth B per GPU, latency α), used by the α–β
                collective model in `collectives.py`

GPU figures: NVIDIA V100, A100, H100/H200 and B200 datasheets (dense fp16/bf16 130 / 312 / 989 /
989 / 2250 TFLOP/s, the V100's being the DGX-2H SXM3 part's; dense FP8 1979 on H100/H200, 4500 on
B200, none before Hopper; HBM 0.9 / 1.555 / 2.039 / 3.35 / 4.8 / 8.0 TB/s; SMs 80 / 108 / 132 /
132 / 148).
Link defaults are achievable bus bandwidths of NCCL ring collectives on large messages (≈ 80 %
of the NVLink per-direction rate: 300 / 450 / 900 GB/s for NVLink 3 / 4 / 5; ≈ 95 % of one 200 Gb/s
HDR or 400 Gb/s NDR NIC per GPU; a DGX-2H's 100 GB/s per 16 GPUs for the V100), overridable with
--intra-bw / --inter-bw. A group spanning nodes uses the NICs of its members in each node
(`Cluster.link`).

A CPU profile (JSON written by `ndtrain plan --calibrate`, read by `cpu_profile.load_profile`)
replaces all of these by what was measured on this machine for a given number of local processes
(`efficiency.measured`, η = 1: the measured matmul rate is already what is achieved), and its
communication never overlaps compute: gloo runs on the same cores.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ndtrain.errors import UserError
from ndtrain.plan.efficiency import GPU_EFFICIENCY, GpuEfficiency
from ndtrain.plan.kernels import DEFAULT, KernelProfile

if TYPE_CHECKING:  # annotations only: cpu_profile builds its profiles on this module
    from ndtrain.plan.cpu_profile import CpuProfile

GIB = 1024**3
GB = 1e9


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s per rank, one direction
    latency: float  # seconds per message step (α)


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model state and per stored activation value."""

    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int


# Rajbhandari 2020 (ZeRO), §3.1: bf16/fp16 weights and gradients, fp32 master weights + Adam
# moments = 2 + 2 + 12 bytes per parameter. Pure fp32 Adam (what CPU processes run): 4 + 4 + 8.
MIXED_BF16 = Precision("bf16-mixed", 2, 2, 12, 2)
FP32 = Precision("fp32", 4, 4, 8, 4)


@dataclass(frozen=True)
class Hardware:
    name: str
    kind: str  # "gpu" or "cpu"
    peak_flops: float
    efficiency: GpuEfficiency
    memory_bytes: float
    reserved_bytes: float  # runtime context, communication buffers, allocator workspace
    hbm_bandwidth: float
    intra: Link
    inter: Link
    precision: Precision
    overlaps_comm: bool  # GPUs communicate beside compute; CPU collectives run on the computing cores
    cpu: CpuProfile | None = None  # what a calibrated CPU profile measured beyond these numbers
    sms: int = 0  # streaming multiprocessors (datasheet), over which GEMM tiles run in waves; 0 on CPUs
    fp8_peak_flops: float = 0.0  # dense FP8 matmul FLOP/s; 0 where the GPU has no FP8 tensor cores
    tensor_cores: str = ""  # volta, ampere, hopper, blackwell: which η_mm applies (`efficiency.py`)
    kernels: KernelProfile = DEFAULT  # the software stack its layers run (`kernels.py`)
    tp_overlap: bool = False  # tensor-parallel collectives run behind the GEMMs (Megatron's --tp-comm-overlap)
    pp_scatter_gather: bool = False  # each tp rank sends 1/t of a pipeline boundary, gathered over tp on arrival
    dp_overlap: bool = True  # data-parallel reduction runs behind the backward (DDP buckets, FSDP, Megatron-Core's
    # --overlap-grad-reduce); False: after the last micro-batch's backward, as Megatron-LM's local DDP of 2021-22
    # and DeepSpeed's pipeline engine (ReduceGrads) run it



def _gpu(name: str, tensor_cores: str, peak_tflops: float, memory_gib: float, hbm_tbs: float, intra_gbs: float,
         inter_gbs: float, sms: int, fp8_tflops: float = 0.0) -> Hardware:
    return Hardware(
        name, "gpu", peak_tflops * 1e12, GPU_EFFICIENCY, memory_gib * GIB, 2 * GIB, hbm_tbs * 1e12,
        Link(intra_gbs * GB, 5e-6), Link(inter_gbs * GB, 10e-6), MIXED_BF16, True, sms=sms,
        fp8_peak_flops=fp8_tflops * 1e12, tensor_cores=tensor_cores,
    )


# η is the same for every GPU but Hopper's bf16 GEMMs (`efficiency.py`): generations differ by their datasheet numbers.
GPUS: dict[str, Hardware] = {
    hw.name: hw
    for hw in (
        _gpu("v100-sxm3", "volta", 130, 32, 0.9, 120, 6.25, 80),
        _gpu("a100-40gb", "ampere", 312, 40, 1.555, 240, 24, 108),
        _gpu("a100-80gb", "ampere", 312, 80, 2.039, 240, 24, 108),
        _gpu("h100-sxm", "hopper", 989, 80, 3.35, 360, 48, 132, 1979),
        _gpu("h200", "hopper", 989, 140, 4.8, 360, 48, 132, 1979),
        _gpu("b200", "blackwell", 2250, 180, 8.0, 720, 48, 148, 4500),
    )
}


def gpu_for_device(device_name: str) -> str | None:
    """The `GPUS` key of a CUDA device by its name (`torch.cuda.get_device_name()`), None for one not listed."""
    name = device_name.lower()
    return "h200" if "h200" in name else "h100-sxm" if "h100" in name else "a100-80gb" if "a100" in name else None


@dataclass(frozen=True)
class Cluster:
    hardware: Hardware
    gpus: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.gpus <= 0:
            raise UserError(f"--gpus {self.gpus} must be > 0")
        if self.gpus_per_node <= 0:
            raise UserError(f"--gpus-per-node {self.gpus_per_node} must be > 0")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise UserError(
                f"--gpus {self.gpus} is not a multiple of --gpus-per-node {self.gpus_per_node}: use whole nodes"
            )

    def pair_link(self, stride: int, size: int) -> Link:
        """The link of a point-to-point send between neighbours of such a group: NVLink when the group
        stays in a node, else one NIC's share per GPU (every GPU in the node sends at the same time,
        each over its own NIC; a pair cannot spread over the node's others as a ring does)."""
        return self.hardware.intra if stride * size <= self.gpus_per_node else self.hardware.inter

    def link(self, stride: int, size: int) -> Link:
        """The link a group of `size` ranks spaced `stride` apart runs its rings over (ranks fill nodes
        in order): NVLink inside a node; across nodes, the NICs of the group's members in each node,
        since NCCL runs one ring per NIC and forwards within the node over NVLink (a group with
        q members per node moves q × one NIC's bandwidth per node, capped by NVLink)."""
        if stride * size <= self.gpus_per_node:
            return self.hardware.intra
        members_per_node = max(1, self.gpus_per_node // stride)
        if members_per_node == 1:
            return self.hardware.inter
        bandwidth = min(self.hardware.intra.bandwidth, members_per_node * self.hardware.inter.bandwidth)
        return Link(bandwidth, self.hardware.inter.latency)


def gpu(name: str, intra_bw_gbs: float | None = None, inter_bw_gbs: float | None = None,
        kernels: KernelProfile | None = None) -> Hardware:
    if name not in GPUS:
        raise UserError(f"--gpu {name!r} is unknown: choose one of {', '.join(GPUS)} (or --profile PATH)")
    hw = GPUS[name]
    if kernels is not None:
        if kernels.fp8 and hw.fp8_peak_flops == 0:
            fp8_gpus = ", ".join(n for n, g in GPUS.items() if g.fp8_peak_flops)
            raise UserError(f"--kernels {kernels.name} runs FP8 GEMMs, which {name} has no tensor cores for: "
                            f"use {fp8_gpus}, or a bf16 profile")
        hw = replace(hw, kernels=kernels)
    for flag, value in (("--intra-bw", intra_bw_gbs), ("--inter-bw", inter_bw_gbs)):
        if value is not None and value <= 0:
            raise UserError(f"{flag} {value} must be > 0 (GB/s per GPU)")
    if intra_bw_gbs is not None:
        hw = replace(hw, intra=Link(intra_bw_gbs * GB, hw.intra.latency))
    if inter_bw_gbs is not None:
        hw = replace(hw, inter=Link(inter_bw_gbs * GB, hw.inter.latency))
    return hw
