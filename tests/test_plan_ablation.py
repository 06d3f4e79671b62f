"""The ablation of docs/planner.md (`ndtrain plan --ablation`): each variant refits the constants with
one term of the GPU model taken out. Pure arithmetic, but a refit per variant: slow."""

from __future__ import annotations

import pytest

from ndtrain.plan import ablation
from ndtrain.plan.efficiency import GPU_EFFICIENCY, GpuEfficiency

VARIANTS = {variant.name: variant for variant in ablation.VARIANTS}


@pytest.mark.slow
def test_all_terms_is_the_planners_model_and_neither_is_the_previous_one() -> None:
    full = ablation.evaluate(VARIANTS["all terms"])
    assert full.constants == GPU_EFFICIENCY and (full.pairs_kept, full.pairs) == (11, 11) and full.bloom_tp4_over_tp8
    previous = ablation.evaluate(VARIANTS["neither (the previous model)"])
    assert previous.constants == GpuEfficiency(matmul=0.76, attention=0.38, element_passes=3.0, overlap_cost=0.8)
    assert previous.pairs_kept == 10 and not previous.bloom_tp4_over_tp8
    # the two new terms lower the H100 rows' signed median error by ~3 points
    assert full.signed_median("h100-sxm") < previous.signed_median("h100-sxm") - 0.025
    table = ablation.table([full, previous])
    assert "| all terms | 0.8, 0.4, 3.0, 0.8 |" in table and "| 11 of 11 | yes |" in table


@pytest.mark.slow
def test_a_fixed_constant_is_held_at_its_value() -> None:
    result = ablation.evaluate(VARIANTS["no overlap cost (φ = 0)"])
    assert result.constants.overlap_cost == 0.0 and result.constants.tile == GPU_EFFICIENCY.tile
