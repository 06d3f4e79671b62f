"""A published run and its source: what every row of the cluster-scale check states.

A row is a run's model, GPU, layout, batch and software stack as its source states them, and the
throughput it reports. The stack is an input: the kernel profile its layers ran (`kernels.py`, read
off the source's code or paper), whether its tensor-parallel collectives overlap the GEMMs, and the
bytes per value its data-parallel reduction (and, where it differs, its parameter gather) moves.
Where the source leaves a detail out, `assumed` says what the planner takes. The rows live with
their sources in `published_pytorch.py` (PyTorch-native stacks) and `published_megatron.py`
(Megatron-LM, Megatron-DeepSpeed, NeMo); `published.py` gathers them.

Throughput is compared as tokens per second per GPU: measured directly (llm-foundry's T/s/GPU,
torchtitan's WPS/TPS, NeMo's tokens/sec/GPU), or global batch × sequence / seconds per iteration /
GPUs, or a reported TFLOP/s per GPU divided by the FLOPs per token of the source's own formula
(`megatron_tokens`: Megatron's count, dense attention, 3 × forward, and the recomputed forward
where the source counts it).

Which rows the constants see: a source is either a fit source (the constants of `efficiency.py` are
fitted on all of them, and `loso.py` validates leave-one-source-out) or held out (`Source.held_out`:
never used in any fit; decided when the source was added, before any of its predictions existed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ndtrain.plan.arch import ModelSpec
from ndtrain.plan.efficiency import GpuEfficiency
from ndtrain.plan.hardware import Cluster, gpu
from ndtrain.plan.kernels import KernelProfile
from ndtrain.plan.layout import Layout
from ndtrain.plan.timing import Timing, step_time

GENERATIONS = {"v100-sxm3": "Volta", "a100-80gb": "Ampere", "a100-40gb": "Ampere", "h100-sxm": "Hopper",
               "h200": "Hopper", "b200": "Blackwell"}


@dataclass(frozen=True)
class Source:
    key: str  # short name, as the tables print it
    title: str
    where: str  # repository/path@commit or URL, and the table or section
    stack: str  # the software stack as the source states it
    held_out: bool = False  # never used in any fit


@dataclass(frozen=True)
class PublishedRun:
    source: Source
    name: str  # the row within its source
    where: str  # the table and the numbers read, where the source's `where` is not enough
    model: ModelSpec
    gpu: str
    layout: Layout
    global_batch: int
    reported: float  # tokens per second per GPU
    kernels: KernelProfile
    assumed: str = ""
    inter_bw_gbs: float | None = None
    grad_reduce_bytes: int = 2  # bytes per gradient value the data-parallel reduction moves, as the run set it
    gather_bytes: int = 2  # bytes per parameter value ZeRO/FSDP gathers (1: FP8 all-gather)
    tp_overlap: bool = False  # tensor-parallel communication overlapped with the GEMMs
    pp_scatter_gather: bool = False  # boundaries sent 1/t per tp rank (Megatron scatter/gather, DeepSpeed partition)
    dp_overlap: bool = True  # data-parallel reduction behind the backward; False: after it, exposed

    @property
    def generation(self) -> str:
        return GENERATIONS[self.gpu]

    def timing(self, efficiency: GpuEfficiency | None = None, kernels: KernelProfile | None = None) -> Timing:
        hardware = replace(gpu(self.gpu, inter_bw_gbs=self.inter_bw_gbs), kernels=kernels or self.kernels,
                           tp_overlap=self.tp_overlap, pp_scatter_gather=self.pp_scatter_gather,
                           dp_overlap=self.dp_overlap)
        if efficiency is not None:
            hardware = replace(hardware, efficiency=efficiency)
        precision = replace(hardware.precision, grad_bytes=self.grad_reduce_bytes, param_bytes=self.gather_bytes)
        hardware = replace(hardware, precision=precision)
        return step_time(self.model, self.layout, Cluster(hardware, self.layout.world, 8), self.global_batch)

    def predicted(self, efficiency: GpuEfficiency | None = None, kernels: KernelProfile | None = None) -> float:
        """Tokens per second per GPU."""
        return self.global_batch * self.model.seq / self.timing(efficiency, kernels).step / self.layout.world

    def error(self, efficiency: GpuEfficiency | None = None) -> float:
        return self.predicted(efficiency) / self.reported - 1


def megatron_tokens(model: ModelSpec, tflops_per_gpu: float, recompute: bool = False) -> float:
    """Tokens/s per GPU of a reported model TFLOP/s per GPU counted as Megatron counts (Narayanan 2021
    §5.1; megatron/training/training.py `num_floating_point_operations`): QKᵀ and AV over the full
    s×s matrix, whatever the kernel, so the dense count of `arch.py`. With `recompute`, the count of
    Narayanan 2021's eq. (3), which adds every layer's recomputed forward (not the logits')."""
    dense = replace(model, flash=False)
    recomputed = dense.layers * dense.layer_forward_flops_per_token if recompute else 0
    return tflops_per_gpu * 1e12 / (dense.model_flops_per_token + recomputed)


def fsdp(gpus: int, mbs: int, recompute: str) -> Layout:
    """FSDP FULL_SHARD / FSDP2: data parallel with every state sharded (ZeRO-3)."""
    return Layout(1, 1, gpus, 1, 3, mbs, 1, recompute, False, "none")


def megatron(tp: int, pp: int, dp: int, mbs: int, recompute: str, sp: bool, zero: int, cp: int = 1,
             vpp: int = 1) -> Layout:
    schedule = "none" if pp == 1 else ("interleaved" if vpp > 1 else "1f1b")
    return Layout(tp, pp, dp, cp, zero, mbs, vpp, recompute, sp, schedule)
