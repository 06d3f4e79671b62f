"""Predicted vs measured step times: the hook for checking the planner against `ndtrain bench`.

Given measured step times per layout (from bench results, once the tp/pp/zero strategies exist),
`compare` predicts each with a calibrated profile and reports
    Spearman's ρ   Pearson correlation of the ranks (ties get their average rank; Spearman 1904)
    median |predicted − measured| / measured
The issue's acceptance: ρ ≥ 0.8 and median relative error ≤ 25 % over ≥ 8 layouts.

`ndtrain plan --validate bench-results/layouts-n4.json --profile plan-profile.json` reads the
result of `ndtrain bench layouts` on CPUs (`load_bench`: each layout's `ParallelConfig` fields and
median step time, the preset, sequence length, global batch and micro-batch size), maps every layout
onto a planner `Layout` (`layout_of`) of the preset's `ModelSpec`, predicts it with the profile
for that many processes, and prints one row per layout and the agreement (`table`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ndtrain.errors import UserError
from ndtrain.plan import arch, jsonfile
from ndtrain.plan.arch import ModelSpec
from ndtrain.plan.hardware import Cluster
from ndtrain.plan.layout import Layout, problem
from ndtrain.plan.timing import Timing, step_time


MIN_LAYOUTS = 8  # the acceptance is over at least this many layouts


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


def layout_of(fields: Mapping[str, Any], mbs: int) -> Layout:
    """The planner's Layout of an Engine layout (`ParallelConfig` fields dp, tp, pp, cp, zero,
    pp_schedule, pp_virtual, sequence_parallel, recompute) run with micro-batches of `mbs` sequences."""
    pp = fields["pp"]
    schedule = fields["pp_schedule"] if pp > 1 else "none"
    return Layout(
        tp=fields["tp"], pp=pp, dp=fields["dp"], cp=fields["cp"], zero=fields["zero"], mbs=mbs,
        vpp=fields["pp_virtual"] if pp > 1 else 1, recompute=fields["recompute"],
        sp=bool(fields["sequence_parallel"]), schedule=schedule,
    )


@dataclass(frozen=True)
class BenchLayouts:
    """What `ndtrain bench layouts` measured: seconds per step of each named layout."""

    model: ModelSpec
    world: int
    global_batch: int
    layouts: dict[str, Layout]
    measured: dict[str, float]


def load_bench(path: Path) -> BenchLayouts:
    """Read a `bench layouts` JSON result; a file that is not one is a UserError naming the fix."""
    data = jsonfile.read(path, "--validate", "a `bench layouts` result", "scenario", "layouts",
                         "run `ndtrain bench layouts --nproc 4`")
    facts, options = data["facts"], data["options"]
    if data.get("device", "cpu") != "cpu":  # results written before the field existed ran on CPUs
        raise UserError(f"--validate: the result was measured on {data['device']}; the planner's local check "
                        "compares with a CPU profile: run `ndtrain bench layouts --nproc 4 --device cpu`")
    model = arch.preset(f"ndtrain-{facts['preset']}", options["seq_len"])
    mbs, global_batch = facts["micro_batch_size"], facts["global_batch"]
    layouts = {name: layout_of(fields, mbs) for name, fields in facts["layouts"].items()}
    for name, fields in facts["layouts"].items():
        if fields["precision"] != "fp32":
            raise UserError(f"--validate: layout {name} ran in {fields['precision']}; the CPU profile models fp32 only")
        wrong = problem(layouts[name], model, data["world_size"], global_batch)
        if wrong is not None:
            raise UserError(f"--validate: layout {name} is not one the planner models: {wrong.message}")
    measured = {name: data["summary"][name]["median_step_s"] for name in layouts}
    return BenchLayouts(model, data["world_size"], global_batch, layouts, measured)


def predictions(bench: BenchLayouts, cluster: Cluster) -> dict[str, Timing]:
    """The planner's step time, and its parts, of each measured layout."""
    return {name: step_time(bench.model, layout, cluster, bench.global_batch) for name, layout in bench.layouts.items()}


def table(bench: BenchLayouts, predicted: Mapping[str, Timing]) -> str:
    """One row per layout (predicted parts — compute with optimizer, exposed communication, bubble,
    shared cores —, predicted step, measured, relative error), then ρ, the median error and the verdict."""
    names = list(bench.layouts)
    result = agreement([predicted[n].step for n in names], [bench.measured[n] for n in names])
    lines = [
        f"planner vs `ndtrain bench layouts`: {bench.model.name} (seq {bench.model.seq}), {bench.world} processes, "
        f"B={bench.global_batch}",
        f"{'layout':<21}{'planner layout':<46}{'compute':>11}{'comm':>11}{'bubble':>11}{'shared':>11}{'predicted':>11}"
        f"{'measured':>11}{'error':>9}",
    ]
    for name in names:
        t, m = predicted[name], bench.measured[name]
        comm = t.tp_comm + t.cp_comm + t.pp_comm + t.dp_comm
        cells = "".join(f"{v * 1e3:>8.1f} ms" for v in (t.compute + t.optimizer, comm, t.bubble, t.shared_cores, t.step, m))
        lines.append(f"{name:<21}{bench.layouts[name].label():<46}{cells}{(t.step - m) / m * 100:>+8.1f}%")
    verdict = "met" if result.acceptable() and result.layouts >= MIN_LAYOUTS else "NOT met"
    lines.append(f"Spearman ρ = {result.spearman:.3f}, median |error| = {result.median_relative_error * 100:.1f} % "
                 f"over {result.layouts} layouts; acceptance (ρ ≥ 0.8, error ≤ 25 %, ≥ 8 layouts): "
                 f"{verdict}")
    return "\n".join(lines)
