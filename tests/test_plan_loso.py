"""Leave-one-source-out validation (`ndtrain/plan/loso.py`, `ndtrain plan --validate`).

The mechanics run in CI with the fit replaced by a recorder (a real fit is seconds of arithmetic per
source); the figures themselves — the constants of efficiency.py are the fit on every fit source,
and the leave-one-source-out and held-out errors docs/planner.md reports — are slow tests."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import pytest

from ndtrain.plan import fit, loso
from ndtrain.plan.efficiency import GPU_EFFICIENCY, GpuEfficiency
from ndtrain.plan.published import SOURCES, fit_runs, held_out_runs
from ndtrain.plan.published_run import PublishedRun
from tests.test_plan_cli import run


class Recorder:
    """Stands in for `fit.fit`: records the rows of each call, returns distinct constants per call."""

    def __init__(self) -> None:
        self.calls: list[list[PublishedRun]] = []

    def __call__(self, rows: Sequence[PublishedRun] | None = None, grid: object = None,
                 tile: object = None) -> GpuEfficiency:
        self.calls.append(list(fit_runs() if rows is None else rows))
        return replace(GPU_EFFICIENCY, matmul=0.5 + 0.01 * len(self.calls))


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    stub = Recorder()
    monkeypatch.setattr(fit, "fit", stub)
    return stub


def test_each_fit_source_is_predicted_by_constants_fitted_without_it(recorder: Recorder) -> None:
    results = loso.leave_one_source_out()
    fit_sources = list(dict.fromkeys(run.source for run in fit_runs()))
    assert [r.source for r in results] == fit_sources and len(recorder.calls) == len(fit_sources)
    for result, rows in zip(results, recorder.calls):
        assert result.source not in {row.source for row in rows}
        assert len(rows) + len(result.rows) == len(fit_runs())
        assert all(not row.source.held_out for row in rows)
        assert result.errors == tuple(row.error(result.constants) for row in result.rows)


def test_held_out_sources_are_predicted_by_the_constants_given() -> None:
    results = loso.held_out(GPU_EFFICIENCY)
    assert {r.source for r in results} == {run.source for run in held_out_runs()}
    assert [row for r in results for row in r.rows] == held_out_runs()
    assert all(r.constants == GPU_EFFICIENCY for r in results)


def test_the_table_gives_each_source_and_all_rows_and_the_verdict() -> None:
    results = loso.held_out(GPU_EFFICIENCY, fit_runs())
    text = loso.table("title", results)
    for r in results:
        line = next(line for line in text.splitlines() if line.startswith(f"| {r.source.key} |"))
        assert f"| {len(r.rows)} | {100 * r.median:.1f} % | {100 * r.worst:.1f} % |" in line
    median, worst, n = loso.overall(results)
    assert f"| all | | | {n} | {100 * median:.1f} % | {100 * worst:.1f} % | |" in text
    assert text.endswith("met") and ("NOT met" in text) == (not loso.within_bounds(results))


def test_validate_without_a_file_prints_both_tables(recorder: Recorder, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--validate"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("leave-one-source-out") and "held out (never in any fit" in out
    for source in SOURCES:
        assert f"| {source.key} |" in out
    assert len(recorder.calls) == len({run.source for run in fit_runs()}) + 1  # one per source, one on all


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_constants_are_the_fit_on_every_fit_source() -> None:
    assert fit.fit() == GPU_EFFICIENCY
