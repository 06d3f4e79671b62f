"""The ablation of docs/planner.md (`ndtrain plan --ablation`): each variant takes one term of the GPU
model out, refits, and is judged leave-one-source-out. Pure arithmetic, but a refit per source and
variant: slow."""

from __future__ import annotations

import pytest

from ndtrain.plan import ablation, loso
from ndtrain.plan.efficiency import GPU_EFFICIENCY

VARIANTS = {variant.name: variant for variant in ablation.VARIANTS}


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two leave-one-source-out passes: ≈ 4 min each on a quiet 2-core machine
def test_all_terms_is_the_planners_model_and_the_one_stack_model_is_worse() -> None:
    full = ablation.evaluate(VARIANTS["all terms"])
    assert full.constants == GPU_EFFICIENCY and full.pairs_kept == full.pairs - 1  # docs/planner.md "Orderings"
    median, worst, rows = loso.overall(full.loso)  # the figures docs/planner.md reports
    assert (round(100 * median, 1), round(100 * worst, 1), rows) == (6.6, 17.9, 49)
    one_stack = ablation.evaluate(next(v for name, v in VARIANTS.items() if name.startswith("one software stack")))
    assert loso.overall(one_stack.loso)[0] > loso.overall(full.loso)[0]  # the stack as an input lowers the median
    assert "| all terms |" in ablation.table([full, one_stack])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_fixed_constant_is_held_at_its_value() -> None:
    result = ablation.evaluate(VARIANTS["no overlap cost (φ = 0)"])
    assert result.constants.overlap_cost == 0.0 and result.constants.tile == GPU_EFFICIENCY.tile
