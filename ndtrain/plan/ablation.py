"""The ablation of docs/planner.md: take one term of the model out (or add one it does not use: wave
quantization), refit, and judge it leave-one-source-out
(`ndtrain plan --ablation`; pure arithmetic, one leave-one-source-out pass per variant, minutes of CPU).

A term or constant earns its place only if it lowers the leave-one-source-out error (issue 32). Each
variant changes the model (a stated constant, or what the published runs are costed with), then runs
`loso.leave_one_source_out` on the changed rows (a grid of one value fixes a constant at that value)
and predicts the held-out sources with the constants fitted on every fit source; the table gives
median and worst |error| of both, and how many compared pairs (`published.ORDERINGS`, by
`report.ORDER_MARGIN`) keep their measured order with the all-source fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ndtrain.plan import fit, loso
from ndtrain.plan.efficiency import GPU_TILE, GpuEfficiency
from ndtrain.plan.kernels import EAGER
from ndtrain.plan.published import ORDERINGS, RUNS
from ndtrain.plan.published_megatron import BIGSCIENCE, OPA_NOMINAL
from ndtrain.plan.published_run import PublishedRun
from ndtrain.plan.report import ordering_pairs


def _same(run: PublishedRun) -> PublishedRun:
    return run


def _one_stack(run: PublishedRun) -> PublishedRun:
    return replace(run, kernels=EAGER)


def _bf16_reduction(run: PublishedRun) -> PublishedRun:
    return replace(run, grad_reduce_bytes=2, gather_bytes=2)


def _no_tp_overlap(run: PublishedRun) -> PublishedRun:
    return replace(run, tp_overlap=False)


def _nominal_links(run: PublishedRun) -> PublishedRun:
    return replace(run, inter_bw_gbs=OPA_NOMINAL) if run.source is BIGSCIENCE else run


@dataclass(frozen=True)
class Variant:
    name: str
    tile: tuple[int, int] | None = None  # GEMM tile for wave quantization (not the planner's model)
    runs: Callable[[PublishedRun], PublishedRun] = _same
    fixed: tuple[tuple[str, float], ...] = ()  # constants held at a value instead of fitted


VARIANTS = (
    Variant("all terms"),
    Variant("one software stack for every run (eager, bf16: the stack a hidden constant)", runs=_one_stack),
    Variant("wave quantization added (128 × 256 output tiles over the GPU's SMs)", tile=GPU_TILE),
    Variant("gradients reduced and parameters gathered in bf16 (the runs' settings ignored)", runs=_bf16_reduction),
    Variant("tensor-parallel overlap ignored", runs=_no_tp_overlap),
    Variant("BigScience's inter-node link at its NICs' nominal rate (its NCCL measurement ignored)",
            runs=_nominal_links),
    Variant("no overlap cost (φ = 0)", fixed=(("overlap_cost", 0.0),)),
    Variant("no element-wise work (η_ew = 1000)", fixed=(("elementwise", 1000.0),)),
)


@dataclass(frozen=True)
class Result:
    variant: Variant
    constants: GpuEfficiency  # fitted on every fit source
    loso: tuple[loso.SourceResult, ...]
    held_out: tuple[loso.SourceResult, ...]
    pairs_kept: int
    pairs: int


def evaluate(variant: Variant) -> Result:
    runs = [variant.runs(run) for run in RUNS]
    grid = {**fit.GRID, **{name: (value,) for name, value in variant.fixed}}
    fitted = [run for run in runs if not run.source.held_out]
    constants = fit.fit(fitted, grid, variant.tile)
    by_key = {(run.source.key, run.name): changed for run, changed in zip(RUNS, runs)}
    pairs = [ok for _, compared in ORDERINGS
             for _, _, ok in ordering_pairs([by_key[(run.source.key, run.name)] for run in compared], constants)]
    return Result(variant, constants, tuple(loso.leave_one_source_out(fitted, grid, variant.tile)),
                  tuple(loso.held_out(constants, [run for run in runs if run.source.held_out])), sum(pairs),
                  len(pairs))


def table(results: list[Result]) -> str:
    lines = ["| model | constants fitted on every fit source (η_mm, η_mm,H, η_attn, η_attn,TE, η_ew, φ, η_fp8) "
             "| leave-one-source-out: median / worst | held out: median / worst | orders kept |",
             "|---|---|---|---|---|"]
    for r in results:
        c = r.constants
        (lm, lw, _), (hm, hw, _) = loso.overall(r.loso), loso.overall(r.held_out)
        lines.append(f"| {r.variant.name} | {c.matmul}, {c.matmul_hopper}, {c.attention}, {c.attention_te}, "
                     f"{c.elementwise}, {c.overlap_cost}, {c.fp8_matmul} | {100 * lm:.1f} / {100 * lw:.1f} % "
                     f"| {100 * hm:.1f} / {100 * hw:.1f} % | {r.pairs_kept} of {r.pairs} |")
    return "\n".join(lines)
