"""The cluster-scale check: published runs recomputed from their recorded data (pure arithmetic).

Acceptance (issue 18): median |error| ≤ 10 % and worst ≤ 20 % on the held-out rows and on all
rows; layouts a source compares are ordered as it measured them.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest

from ndtrain.plan.efficiency import GPU_EFFICIENCY, GpuEfficiency
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


def misses(efficiency: GpuEfficiency | None = None) -> set[tuple[str, str]]:
    return {(faster.source, slower.source) for _, runs in ORDERINGS
            for faster, slower, ok in ordering_pairs(runs, efficiency) if not ok}


def test_compared_layouts_are_ordered_as_measured() -> None:
    assert misses() == set()


def test_bloom_chose_tp4_over_tp8() -> None:  # 3.3 % apart as measured, inside ORDER_MARGIN: checked on its own
    tp4, tp8 = (next(run for run in RUNS if run.source == f"BigScience 181B trial {name}")
                for name in ("tp4 pp12 dp8 mbs2", "tp8 pp6 dp8 mbs4"))
    assert tp4.reported > tp8.reported and tp4.predicted() > tp8.predicted()


def test_without_wave_quantization_the_tp2_over_tp4_pipeline_is_ordered_wrongly() -> None:
    """tp4 pp24 runs 2048-token GEMMs of 672 tiles: 7 waves on 108 SMs, the last 22 % full; tp2's 1344
    tiles fill 13 waves to 96 %. Without that term (same constants) the measured order is reversed."""
    assert misses(replace(GPU_EFFICIENCY, tile=None)) == {
        ("BigScience 181B trial tp2 pp24 dp8 mbs1", "BigScience 181B trial tp4 pp24 dp4 mbs1")}


def test_fp32_gradient_reduction_is_what_the_runs_set() -> None:
    """llm-foundry's MP Mode DEFAULT (Composer 0.16: reduce_dtype fp32) and torchtitan reduce fp32;
    llm-foundry's PURE rows bf16. It slows exactly those rows' data-parallel time."""
    pure = {"llm-foundry A100 80GB with 1600 Gbps node-node interconnect (RoCE) MPT-70b 64 GPUs",
            "llm-foundry A100 80GB with 1600 Gbps node-node interconnect (RoCE) MPT-70b 32 GPUs"}
    for run in RUNS:
        fp32 = run.source.startswith("torchtitan") or (run.source.startswith("llm-foundry") and run.source not in pure)
        assert run.grad_reduce_bytes == (4 if fp32 else 2), run.source
        if fp32:
            bf16 = replace(run, grad_reduce_bytes=2)
            assert run.timing().dp_comm > bf16.timing().dp_comm and run.timing().compute == bf16.timing().compute


def test_every_row_names_where_its_numbers_were_read() -> None:
    for run in RUNS:
        assert run.where and run.reported > 0 and run.metric in ("tokens", "model")


def test_the_constants_are_the_fit_on_the_fit_rows() -> None:  # ≈ 4 s of arithmetic
    assert fit() == GPU_EFFICIENCY
