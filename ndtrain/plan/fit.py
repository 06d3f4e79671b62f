"""Fit the universal GPU efficiencies (`efficiency.py`) on the fit rows of `published.py`.

The objective is the largest |log(predicted / reported)| over the fit rows, then the median
(minimax first: the acceptance bounds the worst row); minimised by coordinate search over a
fixed grid per constant, until no single change improves it, from each of `STARTS` (the search
is local), keeping the best. The GEMM tile is stated, not searched (`efficiency.GPU_TILE`); a grid
of one value fixes that constant (the ablation in `ablation.py` uses both). Pure arithmetic and
deterministic; `ndtrain plan --fit-published` prints the result. It is not applied at run time: the constants in `efficiency.py` are the ones
the planner uses, copied from this fit (tests/test_plan_published.py checks they are its result).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from ndtrain.plan.efficiency import GPU_TILE, GpuEfficiency
from ndtrain.plan.published import RUNS, PublishedRun, held_out

GRID: dict[str, tuple[float, ...]] = {
    "matmul": tuple(round(0.50 + 0.01 * i, 2) for i in range(51)),
    "attention": tuple(round(0.20 + 0.02 * i, 2) for i in range(41)),
    "element_passes": tuple(round(0.5 * i, 1) for i in range(17)),
    "overlap_cost": tuple(round(0.1 * i, 1) for i in range(21)),
}


def fit_rows() -> list[PublishedRun]:
    return [run for i, run in enumerate(RUNS) if not held_out(i)]


def objective(eff: GpuEfficiency, rows: list[PublishedRun]) -> tuple[float, float]:
    errors = [abs(math.log(run.predicted(eff) / run.reported)) for run in rows]
    return max(errors), statistics.median(errors)


STARTS = (
    GpuEfficiency(matmul=0.70, attention=0.50, element_passes=2.0, overlap_cost=0.5),
    GpuEfficiency(matmul=0.65, attention=0.40, element_passes=3.0, overlap_cost=0.8),
    GpuEfficiency(matmul=0.75, attention=0.60, element_passes=1.0, overlap_cost=0.3),
)


def fit(rows: list[PublishedRun] | None = None, grid: dict[str, tuple[float, ...]] | None = None,
        tile: tuple[int, int] | None = GPU_TILE) -> GpuEfficiency:
    rows = fit_rows() if rows is None else rows
    grid = GRID if grid is None else grid
    fixed = {name: values[0] for name, values in grid.items() if len(values) == 1}
    starts = [replace(start, tile=tile, **fixed) for start in STARTS]
    results = [_descend(start, rows, grid) for start in starts]
    return min(results, key=lambda eff: objective(eff, rows))


def _descend(start: GpuEfficiency, rows: list[PublishedRun], grid: dict[str, tuple[float, ...]]) -> GpuEfficiency:
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
