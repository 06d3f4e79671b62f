"""The layout search: enumerate, reject what cannot run or does not fit, rank the rest by speed.

Axes enumerated (each one fixed instead when given on the command line):
    tp         divisors of the GPUs of one node (tensor parallelism stays on NVLink)
    pp         divisors of what tp leaves;  cp  divisors of what tp·pp leaves;  dp = the rest
    zero       0, 1, 2, 3
    mbs        1, 2, 4, 8
    schedule   1f1b, zb, and interleaved with v ∈ {2, 4, 8} (pp > 1 only); gpipe and naive only
               when asked for: gpipe has 1F1B's bubble and more activation memory, naive p× the time
    recompute  none, selective (dense attention only: flash attention always recomputes the
               scores), full
    sp         off, on (tp > 1 only)
A layout is rejected for a structural problem (`layout.problem`) or for needing more memory than
the device has (`dist/memory.py`); the rest are ranked by predicted tokens per second (`timing.py`),
ties going to the simpler layout (fewer model-parallel ranks), then to the smaller one.
When nothing fits, the smallest layouts are returned (marked as not fitting) to show how far off.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

from ndtrain.errors import UserError
from ndtrain.plan.arch import ModelSpec
from ndtrain.plan.hardware import Cluster
from ndtrain.plan.layout import RECOMPUTE, Layout, problem
from ndtrain.plan.memory import Memory, memory
from ndtrain.plan.timing import Timing, step_time

GIB = 1024**3
MICRO_BATCHES = (1, 2, 4, 8)
VIRTUAL_STAGES = (2, 4, 8)
FIXES = {
    "world": "make dp×cp×pp×tp equal --gpus",
    "tp-heads": "choose a --tp that divides the number of heads",
    "tp-kv-heads": "choose a --tp that divides the kv heads or is a multiple of them",
    "pp-layers": "choose a smaller --pp or --vpp",
    "cp-seq": "choose a --cp with 2·cp dividing the sequence length",
    "batch": "make --global-batch a multiple of dp×mbs or change --dp/--mbs",
    "sp": "drop --sp or use --tp > 1",
    "schedule": "match --schedule, --vpp and --pp (interleaved needs vpp ≥ 2 and micro-batches divisible by pp)",
}


@dataclass(frozen=True)
class Fixed:
    """Layout values given on the command line; None means "search over it"."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    cp: int | None = None
    zero: int | None = None
    mbs: int | None = None
    vpp: int | None = None
    recompute: str | None = None
    sp: bool | None = None
    schedule: str | None = None


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: Memory
    timing: Timing
    fits: bool
    tokens_per_s: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float


@dataclass
class Rejections:
    counts: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, kind: str, text: str, keep: int = 3) -> None:
        self.counts[kind] += 1
        examples = self.examples.setdefault(kind, [])
        if len(examples) < keep:
            examples.append(text)


@dataclass(frozen=True)
class SearchResult:
    candidates: list[Candidate]  # the layouts that fit, best first (or, if none fits, the smallest)
    rejections: Rejections
    considered: int


def evaluate(model: ModelSpec, layout: Layout, cluster: Cluster, global_batch: int,
             mem: Memory | None = None) -> Candidate:
    mem = mem or memory(model, layout, cluster, layout.micro_batches(global_batch))
    timing = step_time(model, layout, cluster, global_batch)
    gpus = layout.world
    return Candidate(
        layout, mem, timing, mem.total <= cluster.hardware.memory_bytes,
        tokens_per_s=global_batch * model.seq / timing.step,
        model_tflops_per_gpu=timing.model_flops / timing.step / gpus / 1e12,
        hardware_tflops_per_gpu=timing.hardware_flops / timing.step / gpus / 1e12,
        mfu=timing.model_flops / timing.step / gpus / cluster.hardware.peak_flops,
    )


def search(model: ModelSpec, cluster: Cluster, global_batch: int, fixed: Fixed,
           keep_oversized: int = 5) -> SearchResult:
    """Every layout that fits, fastest first; when none fits, the `keep_oversized` smallest ones."""
    _check_fixed(model, cluster, global_batch, fixed)
    rejections = Rejections()
    fitting: list[Candidate] = []
    oversized: list[tuple[float, Layout, Memory]] = []
    considered = 0
    capacity = cluster.hardware.memory_bytes
    for layout in _layouts(model, cluster, fixed):
        considered += 1
        issue = problem(layout, model, cluster.gpus, global_batch)
        if issue is not None:
            rejections.add(issue.kind, f"{layout.label()}: {issue.message}")
            continue
        mem = memory(model, layout, cluster, layout.micro_batches(global_batch))
        if mem.total <= capacity:
            fitting.append(evaluate(model, layout, cluster, global_batch, mem))
        else:
            oversized.append((mem.total, layout, mem))
            rejections.add("memory", f"{layout.label()}: needs {mem.total / GIB:.1f} GiB > {capacity / GIB:.1f} GiB")
    if not fitting and not oversized:
        raise UserError(_no_layout_message(rejections))
    fitting.sort(key=_rank_key)
    if not fitting:
        oversized.sort(key=lambda item: item[0])
        fitting = [evaluate(model, layout, cluster, global_batch, mem) for _, layout, mem in oversized[:keep_oversized]]
    return SearchResult(fitting, rejections, considered)


def _rank_key(c: Candidate) -> tuple[float, int, float]:
    """Fastest first; at equal speed (to 6 digits) the fewest model-parallel ranks, then the least memory."""
    speed = float(f"{c.tokens_per_s:.6g}")
    return -speed, c.layout.tp * c.layout.pp * c.layout.cp, c.memory.total


def _check_fixed(model: ModelSpec, cluster: Cluster, global_batch: int, fixed: Fixed) -> None:
    if global_batch <= 0:
        raise UserError(f"--global-batch {global_batch} must be > 0 (sequences per step)")
    for flag, value in (("--tp", fixed.tp), ("--pp", fixed.pp), ("--dp", fixed.dp), ("--cp", fixed.cp),
                        ("--mbs", fixed.mbs), ("--vpp", fixed.vpp)):
        if value is not None and value <= 0:
            raise UserError(f"{flag} {value} must be > 0")
    axes = [(flag, value) for flag, value in (("--tp", fixed.tp), ("--pp", fixed.pp), ("--cp", fixed.cp),
                                               ("--dp", fixed.dp)) if value is not None]
    product = 1
    for flag, value in axes:
        product *= value
        if cluster.gpus % product:
            given = axes[: axes.index((flag, value)) + 1]
            named = " × ".join(f"{f} {v}" for f, v in given) + (f" = {product}" if len(given) > 1 else "")
            raise UserError(f"{named} does not divide --gpus {cluster.gpus}: choose axes whose product divides it")
    if fixed.recompute is not None and fixed.recompute not in RECOMPUTE:
        raise UserError(f"--recompute {fixed.recompute!r} is unknown: choose one of {', '.join(RECOMPUTE)}")
    if fixed.zero is not None and fixed.zero not in (0, 1, 2, 3):
        raise UserError(f"--zero {fixed.zero} is not a ZeRO stage: choose 0, 1, 2 or 3")
    if len(axes) == 4 and product != cluster.gpus:
        raise UserError(f"dp×cp×pp×tp = {product} ≠ --gpus {cluster.gpus}: make the layout use every GPU")


def _no_layout_message(rejections: Rejections) -> str:
    kind, _ = rejections.counts.most_common(1)[0]
    example = rejections.examples[kind][0].split(": ", 1)[1]
    return f"{example}: {FIXES.get(kind, 'change the layout flags')}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts(model: ModelSpec, cluster: Cluster, fixed: Fixed) -> Iterator[Layout]:
    gpus = cluster.gpus
    node = min(gpus, cluster.gpus_per_node)
    for tp in [fixed.tp] if fixed.tp else _divisors(node):
        if gpus % tp:
            continue
        for pp in [fixed.pp] if fixed.pp else _divisors(gpus // tp):
            if gpus % (tp * pp):
                continue
            for cp in [fixed.cp] if fixed.cp else _divisors(gpus // (tp * pp)):
                if gpus % (tp * pp * cp):
                    continue
                dp = fixed.dp or gpus // (tp * pp * cp)
                for zero, mbs, recompute, sp, (schedule, vpp) in itertools.product(
                    [fixed.zero] if fixed.zero is not None else (0, 1, 2, 3),
                    [fixed.mbs] if fixed.mbs else MICRO_BATCHES,
                    [fixed.recompute] if fixed.recompute else _recompute_options(model),
                    [fixed.sp] if fixed.sp is not None else ([False, True] if tp > 1 else [False]),
                    _schedules(model, pp, fixed),
                ):
                    yield Layout(tp, pp, dp, cp, zero, mbs, vpp, recompute, sp, schedule)


def _recompute_options(model: ModelSpec) -> tuple[str, ...]:
    return ("none", "full") if model.flash_attention else RECOMPUTE


def _schedules(model: ModelSpec, pp: int, fixed: Fixed) -> list[tuple[str, int]]:
    if fixed.schedule is not None:
        if fixed.schedule == "interleaved":
            return [("interleaved", v) for v in ([fixed.vpp] if fixed.vpp else VIRTUAL_STAGES)]
        return [(fixed.schedule, fixed.vpp or 1)]
    if fixed.vpp is not None and fixed.vpp > 1:
        return [("interleaved", fixed.vpp)]
    if pp == 1:
        return [("none", 1)]
    plain = [("1f1b", 1), ("zb", 1)]  # gpipe, naive: only when asked for (see the docstring)
    return plain + [("interleaved", v) for v in VIRTUAL_STAGES if pp * v <= model.layers]
