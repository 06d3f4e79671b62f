"""The ablation of docs/planner.md: refit the GPU constants with one term of the model taken out, and
report what the published check then gives (`ndtrain plan --ablation`; pure arithmetic, ≈ 15 s of CPU).

Each variant changes the model (a stated constant, or what the published runs are costed with), refits
the fitted constants on the fit rows with `fit.fit` (a grid of one value fixes a constant at that value),
and evaluates every row: median and worst |error| on all rows and on the held-out rows, the signed
median per GPU generation, and how many compared pairs (`published.ORDERINGS`, by `report.ORDER_MARGIN`)
keep their measured order, plus BLOOM's TP4-over-TP8 choice, which is inside that margin.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Callable

from ndtrain.plan import fit
from ndtrain.plan.efficiency import GPU_TILE, GpuEfficiency
from ndtrain.plan.published import ORDERINGS, RUNS, PublishedRun, held_out
from ndtrain.plan.report import ordering_pairs


def _same(run: PublishedRun) -> PublishedRun:
    return run


def _bf16_reduction(run: PublishedRun) -> PublishedRun:
    return replace(run, grad_reduce_bytes=2)


@dataclass(frozen=True)
class Variant:
    name: str
    tile: tuple[int, int] | None = GPU_TILE
    runs: Callable[[PublishedRun], PublishedRun] = _same
    fixed: tuple[tuple[str, float], ...] = ()  # constants held at a value instead of fitted


VARIANTS = (
    Variant("all terms"),
    Variant("no wave quantization", tile=None),
    Variant("gradients reduced in bf16 (the runs' fp32 reduction ignored)", runs=_bf16_reduction),
    Variant("neither (the previous model)", tile=None, runs=_bf16_reduction),
    Variant("tile 128×128 instead of 128×256", tile=(128, 128)),
    Variant("no overlap cost (φ = 0)", fixed=(("overlap_cost", 0.0),)),
    Variant("no element-wise work (e = 0)", fixed=(("element_passes", 0.0),)),
)


@dataclass(frozen=True)
class Result:
    variant: Variant
    constants: GpuEfficiency
    errors: tuple[float, ...]  # signed, per row of RUNS
    pairs_kept: int
    pairs: int
    bloom_tp4_over_tp8: bool

    def summary(self, rows: str) -> tuple[float, float]:
        chosen = [abs(e) for i, e in enumerate(self.errors) if rows == "all" or held_out(i)]
        return statistics.median(chosen), max(chosen)

    def signed_median(self, gpu: str) -> float:
        return statistics.median(e for run, e in zip(RUNS, self.errors) if run.gpu == gpu)


def evaluate(variant: Variant) -> Result:
    runs = [variant.runs(run) for run in RUNS]
    grid = {**fit.GRID, **{name: (value,) for name, value in variant.fixed}}
    constants = fit.fit([run for i, run in enumerate(runs) if not held_out(i)], grid, variant.tile)
    errors = tuple(run.predicted(constants) / run.reported - 1 for run in runs)
    by_source = {run.source: changed for run, changed in zip(RUNS, runs)}
    pairs = [ok for _, compared in ORDERINGS
             for _, _, ok in ordering_pairs([by_source[run.source] for run in compared], constants)]
    tp4, tp8 = (by_source[f"BigScience 181B trial {name}"] for name in ("tp4 pp12 dp8 mbs2", "tp8 pp6 dp8 mbs4"))
    return Result(variant, constants, errors, sum(pairs), len(pairs),
                  tp4.predicted(constants) > tp8.predicted(constants))


def table(results: list[Result]) -> str:
    lines = ["| model | constants (η_mm, η_attn, e, φ) | all: median / worst | held out: median / worst "
             "| A100 / H100 signed median | orders kept | BLOOM TP4 > TP8 |", "|---|---|---|---|---|---|---|"]
    for r in results:
        c = r.constants
        (am, aw), (hm, hw) = r.summary("all"), r.summary("held out")
        lines.append(f"| {r.variant.name} | {c.matmul}, {c.attention}, {c.element_passes}, {c.overlap_cost} "
                     f"| {100 * am:.1f} / {100 * aw:.1f} % | {100 * hm:.1f} / {100 * hw:.1f} % "
                     f"| {100 * r.signed_median('a100-80gb'):+.1f} / {100 * r.signed_median('h100-sxm'):+.1f} % "
                     f"| {r.pairs_kept} of {r.pairs} | {'yes' if r.bloom_tp4_over_tp8 else 'no'} |")
    return "\n".join(lines)
