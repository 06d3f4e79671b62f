"""The planner's fitted constants for GPUs: one set for every GPU generation and software stack.

Each is a property of kernels: what differs between generations enters through datasheet numbers
(peak FLOP/s, FP8 peak, HBM bandwidth, SM count, link bandwidths) in `gpu_compute.py` and
`timing.py`, and through one fitted fraction, the bf16 GEMM efficiency of Hopper's tensor cores
(η_mm,H; Blackwell has no bf16 row and takes Hopper's); what differs between software stacks
through the run's kernel profile (`kernels.py`: the element-wise bytes each stack's kernels move,
whether its GEMMs run in FP8, which attention kernel it calls), which is stated, with one fitted
efficiency per attention kernel family. The seven fractions are fitted on the published runs of every
source but the held-out ones (`published.py`) by `fit.py`, and validated leave-one-source-out
(`loso.py`). Wave quantization (a stated GEMM tile: the output block one SM computes, which with
the GPU's SM count sets how full a GEMM's last wave of tiles is) is a term the planner does not use:
leave-one-source-out it raised the error (docs/planner.md, "What each term does"); `GPU_TILE` is the
tile the ablation tries.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuEfficiency:
    matmul: float  # η_mm: fraction of the bf16/fp16 peak a GEMM's arithmetic reaches (Volta, Ampere)
    matmul_hopper: float  # η_mm,H: the same on Hopper (and Blackwell) tensor cores
    attention: float  # η_attn: fraction of the bf16 peak PyTorch's fused attention kernels reach
    attention_te: float  # η_attn,TE: the same for Transformer Engine's (cuDNN) fused attention
    elementwise: float  # η_ew: fraction of the HBM bandwidth element-wise kernels reach
    overlap_cost: float  # φ: seconds of compute lost per second of communication running behind it
    fp8_matmul: float  # η_fp8: fraction of the FP8 peak an FP8 GEMM's arithmetic reaches
    tile: tuple[int, int] | None = None  # GEMM output tile (rows × columns) per SM; None: no wave quantization

    def gemm(self, tensor_cores: str) -> float:
        return self.matmul_hopper if tensor_cores in ("hopper", "blackwell") else self.matmul

    def flash(self, kernel: str) -> float:
        return self.attention_te if kernel == "te" else self.attention


# 128 × 256: the large bf16 tensor-core tile of CUTLASS/cuBLAS kernels on Ampere and Hopper (stated), for the
# ablation's wave-quantization variant.
GPU_TILE = (128, 256)
GPU_EFFICIENCY = GpuEfficiency(matmul=0.86, matmul_hopper=0.68, attention=0.26, attention_te=0.34, elementwise=1.0,
                               overlap_cost=0.75, fp8_matmul=0.72)


def measured(elementwise: float = 1.0) -> GpuEfficiency:
    """A CPU profile's constants: its rates are measured (η = 1; element-wise at the fraction of the
    copy bandwidth ndtrain's own element-wise code reached in the calibration), nothing overlaps
    (gloo runs on the computing cores), no tiles are scheduled on SMs, no FP8."""
    return GpuEfficiency(matmul=1.0, matmul_hopper=1.0, attention=1.0, attention_te=1.0, elementwise=elementwise,
                         overlap_cost=0.0, fp8_matmul=1.0)

