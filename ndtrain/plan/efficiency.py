"""The planner's fitted constants for GPUs: one set for every GPU generation.

Each is a property of the software's kernels, not of a GPU: what differs between generations
enters only through datasheet numbers (peak FLOP/s, HBM bandwidth, link bandwidths) in
`gpu_compute.py` and `timing.py`. The four fractions are fitted on the fit rows of `published.py`
(every row except every third, see there) by `fit.py`; docs/planner.md reports fit and held-out
errors apart. The GEMM tile is stated, not fitted: the output block one SM computes, which with the
GPU's SM count (a datasheet number) sets how full a GEMM's last wave of tiles is.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuEfficiency:
    matmul: float  # η_mm: fraction of peak the arithmetic of a GEMM reaches
    attention: float  # η_attn: fraction of peak the attention kernel's FLOPs reach
    element_passes: float  # e: passes over a layer's activation bytes of memory-bound element-wise work
    overlap_cost: float  # φ: seconds of compute lost per second of communication running behind it
    tile: tuple[int, int] | None = None  # GEMM output tile (rows × columns) per SM; None: no wave quantization


# 128 × 256: the large bf16 tensor-core tile of CUTLASS/cuBLAS kernels on Ampere and Hopper (stated).
GPU_TILE = (128, 256)
GPU_EFFICIENCY = GpuEfficiency(matmul=0.80, attention=0.40, element_passes=3.0, overlap_cost=0.8, tile=GPU_TILE)

# A CPU profile's rates are measured (η = 1), its element-wise work two passes per forward, nothing
# overlaps (gloo runs on the computing cores), and no tiles are scheduled on SMs.
MEASURED = GpuEfficiency(matmul=1.0, attention=1.0, element_passes=2.0, overlap_cost=0.0)
