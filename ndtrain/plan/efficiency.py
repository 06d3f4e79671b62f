"""The planner's fitted constants for GPUs: one set for every GPU generation.

Each is a property of the software's kernels, not of a GPU: what differs between generations
enters only through datasheet numbers (peak FLOP/s, HBM bandwidth, link bandwidths) in
`gpu_compute.py` and `timing.py`. Fitted on the fit rows of `published.py` (every row except
every third, see there) by `fit.py`; docs/planner.md reports fit and held-out errors apart.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuEfficiency:
    matmul: float  # η_mm: fraction of peak the arithmetic of a GEMM reaches
    attention: float  # η_attn: fraction of peak the attention kernel's FLOPs reach
    element_passes: float  # e: passes over a layer's activation bytes of memory-bound element-wise work
    overlap_cost: float  # φ: seconds of compute lost per second of communication running behind it


GPU_EFFICIENCY = GpuEfficiency(matmul=0.76, attention=0.38, element_passes=3.0, overlap_cost=0.8)

# A CPU profile's rates are measured (η = 1), its element-wise work two passes per forward, and
# nothing overlaps (gloo runs on the computing cores).
MEASURED = GpuEfficiency(matmul=1.0, attention=1.0, element_passes=2.0, overlap_cost=0.0)
