"""Fit the GPU efficiency constants (`efficiency.py`) on published runs (`published.py`).

The objective is the mean squared log(predicted / reported) of each source's rows, averaged over
the sources (each source weighs the same however many rows it has: a source is one system, and the
validation leaves out sources), then the worst row; minimised by coordinate search over a fixed
grid per constant (fractions 0.20 … 1.00 by 0.02, φ 0 … 1 by 0.05: no constant beyond its physical
bound), until no single change improves it (first on every `COARSE`-th value, then on all), from
each of `STARTS` (the search is local), keeping the best. A GEMM tile, when given (the ablation's
wave-quantization variant, `efficiency.GPU_TILE`), is stated, not searched; a grid of one value fixes
a constant (`ablation.py`). A constant no row
depends on (FP8 GEMMs when no row runs them) keeps its start value. Pure arithmetic and
deterministic, ≈ 20 s of CPU on the fit sources' rows. `ndtrain plan --fit-published` prints the
fit on every fit source; `loso.py` refits without each source in turn. It is not applied at run
time: the constants in `efficiency.py` are the ones the planner uses, copied from this fit
(tests/test_plan_loso.py checks they are its result).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Sequence

from ndtrain.plan.efficiency import GpuEfficiency
from ndtrain.plan.published import fit_runs
from ndtrain.plan.published_run import PublishedRun

FRACTION = tuple(round(0.20 + 0.02 * i, 2) for i in range(41))  # 0.20 … 1.00
GRID: dict[str, tuple[float, ...]] = {
    "matmul": FRACTION,
    "matmul_hopper": FRACTION,
    "attention": FRACTION,
    "attention_te": FRACTION,
    "elementwise": FRACTION,
    "overlap_cost": tuple(round(0.05 * i, 2) for i in range(21)),  # 0 … 1
    "fp8_matmul": FRACTION,
}

COARSE = 4  # a first descent on every 4th grid value, then one on the whole grid from where it ended

STARTS = (
    GpuEfficiency(matmul=0.70, matmul_hopper=0.70, attention=0.50, attention_te=0.50, elementwise=0.6,
                  overlap_cost=0.5, fp8_matmul=0.6),
    GpuEfficiency(matmul=0.80, matmul_hopper=0.80, attention=0.40, attention_te=0.40, elementwise=0.8,
                  overlap_cost=0.8, fp8_matmul=0.5),
    GpuEfficiency(matmul=0.75, matmul_hopper=0.60, attention=0.60, attention_te=0.60, elementwise=0.4,
                  overlap_cost=0.3, fp8_matmul=0.7),
)


def objective(eff: GpuEfficiency, rows: Sequence[PublishedRun]) -> tuple[float, float]:
    """(mean over sources of the mean squared log error of their rows, the largest |log error|)."""
    by_source: dict[object, list[float]] = {}
    for run in rows:
        by_source.setdefault(run.source, []).append(math.log(run.predicted(eff) / run.reported))
    per_source = [statistics.fmean(e * e for e in errors) for errors in by_source.values()]
    return statistics.fmean(per_source), max(abs(e) for errors in by_source.values() for e in errors)


def fit(rows: Sequence[PublishedRun] | None = None, grid: dict[str, tuple[float, ...]] | None = None,
        tile: tuple[int, int] | None = None) -> GpuEfficiency:
    rows = fit_runs() if rows is None else list(rows)
    grid = dict(GRID if grid is None else grid)
    unused = {"fp8_matmul": not any(run.kernels.fp8 for run in rows),
              "attention_te": not any(run.kernels.attention == "te" and run.model.flash_attention for run in rows),
              "matmul_hopper": not any(run.generation in ("Hopper", "Blackwell") for run in rows)}
    for name, idle in unused.items():
        if idle and len(grid[name]) > 1:
            grid[name] = (getattr(STARTS[0], name),)
    fixed = {name: values[0] for name, values in grid.items() if len(values) == 1}
    coarse = {name: values[::COARSE] for name, values in grid.items()}
    starts = [replace(start, tile=tile, **fixed) for start in STARTS]
    results = [_descend(_descend(start, rows, coarse), rows, grid) for start in starts]
    return min(results, key=lambda eff: objective(eff, rows))


def _descend(start: GpuEfficiency, rows: Sequence[PublishedRun], grid: dict[str, tuple[float, ...]]) -> GpuEfficiency:
    best, best_score = start, objective(start, rows)
    improved = True
    while improved:
        improved = False
        for name in grid:
            for value in grid[name]:
                candidate = replace(best, **{name: value})
                score = objective(candidate, rows)
                if score < best_score:
                    best, best_score, improved = candidate, score, True
    return best
