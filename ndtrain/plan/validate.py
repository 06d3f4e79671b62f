"""Predicted vs measured step times: the hook for checking the planner against `ndtrain bench`.

Given measured step times per layout (from bench results, once the tp/pp/zero strategies exist),
`compare` predicts each with a calibrated profile and reports
    Spearman's ρ   Pearson correlation of the ranks (ties get their average rank; Spearman 1904)
    median |predicted − measured| / measured
The issue's acceptance: ρ ≥ 0.8 and median relative error ≤ 25 % over ≥ 8 layouts.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

from ndtrain.plan.arch import ModelSpec
from ndtrain.plan.hardware import Cluster
from ndtrain.plan.layout import Layout
from ndtrain.plan.timing import step_time


@dataclass(frozen=True)
class Agreement:
    layouts: int
    spearman: float
    median_relative_error: float

    def acceptable(self, min_spearman: float = 0.8, max_error: float = 0.25) -> bool:
        return self.spearman >= min_spearman and self.median_relative_error <= max_error


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    result = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for i in order[start:end + 1]:
            result[i] = (start + end) / 2 + 1
        start = end + 1
    return result


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    norm = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / norm if norm else 0.0


def agreement(predicted: Sequence[float], measured: Sequence[float]) -> Agreement:
    if len(predicted) != len(measured) or len(predicted) < 2:
        raise ValueError("need at least two (predicted, measured) pairs of equal length")
    errors = [abs(p - m) / m for p, m in zip(predicted, measured)]
    return Agreement(len(predicted), spearman(predicted, measured), statistics.median(errors))


def compare(measured: Mapping[Layout, float], model: ModelSpec, cluster: Cluster, global_batch: int) -> Agreement:
    """Agreement of the planner's step times with `measured` seconds per step, layout by layout."""
    layouts = list(measured)
    predicted = [step_time(model, layout, cluster, global_batch).step for layout in layouts]
    return agreement(predicted, [measured[layout] for layout in layouts])
