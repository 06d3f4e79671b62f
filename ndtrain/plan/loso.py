"""Leave-one-source-out validation of the planner, and its check on held-out sources (`ndtrain plan --validate`).

For each fit source S in turn, the constants of `efficiency.py` are refitted (`fit.fit`) on the rows
of every other fit source and S's rows are predicted with them: what the planner would say about a
system it was never shown. Reported per source (median and worst |error|, rows, GPU generations, the
stack) and over all rows. The held-out sources (`Source.held_out`) are never in any fit: they are
predicted with the constants fitted on all fit sources, which are the planner's (`efficiency.py`).
Acceptance (issue 32): median ≤ 10 % and worst ≤ 20 %, leave-one-source-out and held out alike.
Pure arithmetic: one refit per fit source, ≈ 10 s in all.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from ndtrain.plan import fit
from ndtrain.plan.efficiency import GpuEfficiency
from ndtrain.plan.published import SOURCES, fit_runs, held_out_runs
from ndtrain.plan.published_run import PublishedRun, Source

MEDIAN_BOUND, WORST_BOUND = 0.10, 0.20


@dataclass(frozen=True)
class SourceResult:
    source: Source
    constants: GpuEfficiency  # what its rows were predicted with
    rows: tuple[PublishedRun, ...]
    errors: tuple[float, ...]  # signed relative error of each row

    @property
    def median(self) -> float:
        return statistics.median(abs(e) for e in self.errors)

    @property
    def worst(self) -> float:
        return max(abs(e) for e in self.errors)


def _result(source: Source, rows: Sequence[PublishedRun], constants: GpuEfficiency) -> SourceResult:
    return SourceResult(source, constants, tuple(rows), tuple(run.error(constants) for run in rows))


def leave_one_source_out(runs: Sequence[PublishedRun] | None = None, grid: dict[str, tuple[float, ...]] | None = None,
                         tile: tuple[int, int] | None = None) -> list[SourceResult]:
    runs = fit_runs() if runs is None else list(runs)
    results = []
    for source in dict.fromkeys(run.source for run in runs):
        others = [run for run in runs if run.source != source]
        mine = [run for run in runs if run.source == source]
        results.append(_result(source, mine, fit.fit(others, grid, tile)))
    return results


def held_out(constants: GpuEfficiency, runs: Sequence[PublishedRun] | None = None) -> list[SourceResult]:
    runs = held_out_runs() if runs is None else list(runs)
    return [_result(source, [run for run in runs if run.source == source], constants)
            for source in SOURCES if any(run.source == source for run in runs)]


def overall(results: Sequence[SourceResult]) -> tuple[float, float, int]:
    errors = [abs(e) for r in results for e in r.errors]
    return statistics.median(errors), max(errors), len(errors)


def within_bounds(results: Sequence[SourceResult]) -> bool:
    median, worst, _ = overall(results)
    return median <= MEDIAN_BOUND and worst <= WORST_BOUND


def table(title: str, results: Sequence[SourceResult]) -> str:
    lines = [title, "| source | GPUs (generation) | stack (profile) | rows | median | worst | signed median |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        gpus = ", ".join(dict.fromkeys(f"{run.gpu} ({run.generation})" for run in r.rows))
        profiles = ", ".join(dict.fromkeys(run.kernels.name for run in r.rows))
        lines.append(f"| {r.source.key} | {gpus} | {profiles} | {len(r.rows)} | {100 * r.median:.1f} % "
                     f"| {100 * r.worst:.1f} % | {100 * statistics.median(r.errors):+.1f} % |")
    median, worst, n = overall(results)
    verdict = "met" if within_bounds(results) else "NOT met"
    lines.append(f"| all | | | {n} | {100 * median:.1f} % | {100 * worst:.1f} % | |")
    lines.append(f"bounds (median ≤ {100 * MEDIAN_BOUND:.0f} %, worst ≤ {100 * WORST_BOUND:.0f} %): {verdict}")
    return "\n".join(lines)


def rows_table(results: Sequence[SourceResult]) -> str:
    """Every row with its prediction and the constants it was predicted with."""
    lines = ["| source | row | GPU | layout | profile | reported tok/s/GPU | predicted | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for run, error in zip(r.rows, r.errors):
            lines.append(f"| {r.source.key} | {run.name} | {run.gpu} | {run.layout.label()} B={run.global_batch} "
                         f"| {run.kernels.name} | {run.reported:.1f} | {run.predicted(r.constants):.1f} "
                         f"| {100 * error:+.1f} % |")
    return "\n".join(lines)


def report() -> str:
    """What `ndtrain plan --validate` prints: the leave-one-source-out table, the held-out table, and
    the constants each was predicted with."""
    loso = leave_one_source_out()
    constants = fit.fit()
    parts = [table("leave-one-source-out (each source predicted by constants fitted on the others):", loso),
             "", table("held out (never in any fit; predicted by the constants fitted on every fit source):",
                       held_out(constants)),
             "", f"constants fitted on every fit source: {constants}"]
    parts += [f"  without {r.source.key}: {r.constants}" for r in loso]
    return "\n".join(parts)
