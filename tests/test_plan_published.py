"""The cluster-scale check: published runs recomputed from their recorded data (pure arithmetic).

Acceptance (issue 18): median |error| ≤ 10 % and worst ≤ 20 % on the held-out rows and on all
rows; layouts a source compares are ordered as it measured them.
"""

from __future__ import annotations

import statistics

import pytest

from ndtrain.plan.efficiency import GPU_EFFICIENCY
from ndtrain.plan.fit import fit
from ndtrain.plan.published import ORDERINGS, RUNS, held_out
from ndtrain.plan.report import ordering_pairs

ERRORS = [(held_out(i), run.error()) for i, run in enumerate(RUNS)]


def test_the_table_has_25_rows_from_5_sources_on_3_generations() -> None:
    assert len(RUNS) >= 25
    assert len({run.where.split(" ")[0].split("@")[0].split("/")[0] for run in RUNS}) >= 5
    assert {run.gpu for run in RUNS} >= {"v100-sxm3", "a100-80gb", "h100-sxm"}
    assert sum(held for held, _ in ERRORS) == len(RUNS) // 3  # every third row by source order


@pytest.mark.parametrize("part", ["held out", "all"])
def test_median_error_at_most_10_and_worst_at_most_20_percent(part: str) -> None:
    errors = [abs(e) for held, e in ERRORS if held or part == "all"]
    assert statistics.median(errors) <= 0.10
    assert max(errors) <= 0.20


# The one pair not reproduced (docs/planner.md): tp2 pp24 dp8 measured 9 % faster than tp4 pp24 dp4,
# predicted 1 % slower (it has twice the micro-batches, whose fixed per-micro-batch costs the model omits).
KNOWN_MISSES = {("BigScience 181B trial tp2 pp24 dp8 mbs1", "BigScience 181B trial tp4 pp24 dp4 mbs1")}


def test_compared_layouts_are_ordered_as_measured() -> None:
    misses = set()
    for _, runs in ORDERINGS:
        misses |= {(faster.source, slower.source) for faster, slower, ok in ordering_pairs(runs) if not ok}
    assert misses == KNOWN_MISSES


def test_every_row_names_where_its_numbers_were_read() -> None:
    for run in RUNS:
        assert run.where and run.reported > 0 and run.metric in ("tokens", "model")


def test_the_constants_are_the_fit_on_the_fit_rows() -> None:  # ≈ 4 s of arithmetic
    assert fit() == GPU_EFFICIENCY
