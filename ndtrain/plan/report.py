"""What the planner prints: the top layouts as a table, their JSON, and the rejection summary.

JSON (`--json`): {"candidates": [...]} best first, each with its layout, whether it fits, the
memory breakdown in GiB, the step time and its breakdown in seconds, tokens/s, model and
hardware TFLOP/s per GPU (hardware includes recompute) and MFU = model FLOP/s ÷ peak.
"""

from __future__ import annotations

import itertools
import json
import statistics
from typing import Any, Sequence

from ndtrain.plan import gpu_compute
from ndtrain.plan.arch import ModelSpec
from ndtrain.plan.efficiency import GpuEfficiency
from ndtrain.plan.hardware import Cluster, Hardware
from ndtrain.plan.layout import Layout
from ndtrain.plan.published import ORDERINGS, RUNS, PublishedRun
from ndtrain.plan.search import Candidate, Rejections, SearchResult

GIB = 1024**3
TIME_PARTS = ("compute", "tp_comm", "cp_comm", "pp_comm", "bubble", "dp_comm", "optimizer")


def candidate_dict(candidate: Candidate) -> dict[str, Any]:
    timing = candidate.timing
    return {
        "layout": candidate.layout.as_dict(),
        "fits": candidate.fits,
        "memory_gib": candidate.memory.gib(),
        "step_time_s": round(timing.step, 6),
        "time_s": {part: round(getattr(timing, part), 6) for part in TIME_PARTS},
        "tokens_per_s": round(candidate.tokens_per_s, 3),
        "model_tflops_per_gpu": round(candidate.model_tflops_per_gpu, 4),
        "hardware_tflops_per_gpu": round(candidate.hardware_tflops_per_gpu, 4),
        "mfu": round(candidate.mfu, 4),
    }


def to_json(result: SearchResult, top: int) -> str:
    return json.dumps({"candidates": [candidate_dict(c) for c in result.candidates[:top]]}, indent=2)


def header(model: ModelSpec, cluster: Cluster, global_batch: int) -> str:
    hw = cluster.hardware
    return (f"{model.name}: {model.total_params / 1e9:.3f} B parameters, {model.layers} layers, h={model.hidden}, "
            f"seq {model.seq}; {cluster.gpus} × {hw.name} ({cluster.gpus_per_node} per node, "
            f"{hw.memory_bytes / GIB:.0f} GiB, peak {hw.peak_flops / 1e12:.4g} TFLOP/s); "
            f"global batch {global_batch} sequences")


def table(result: SearchResult, top: int) -> str:
    columns = ("#", "tp", "pp", "dp", "cp", "zero", "mbs", "schedule", "recompute", "sp",
               "mem GiB", "params/grads/opt/act", "step s", "compute/tp/cp/pp/bubble/dp/opt s",
               "tokens/s", "TFLOP/s", "MFU", "fits")
    rows = [columns]
    for rank, c in enumerate(result.candidates[:top], 1):
        lay, mem, tm = c.layout, c.memory, c.timing
        schedule = lay.schedule + (f"×{lay.vpp}" if lay.vpp > 1 else "")
        states = "/".join(f"{getattr(mem, part) / GIB:.1f}" for part in ("params", "grads", "optimizer", "activations"))
        parts = "/".join(_short(getattr(tm, part)) for part in TIME_PARTS)
        rows.append((str(rank), str(lay.tp), str(lay.pp), str(lay.dp), str(lay.cp), str(lay.zero), str(lay.mbs),
                     schedule, lay.recompute, "on" if lay.sp else "off", f"{mem.total / GIB:.1f}", states,
                     f"{tm.step:.3g}", parts, f"{c.tokens_per_s:,.0f}", f"{c.model_tflops_per_gpu:.4g}",
                     f"{100 * c.mfu:.1f}%", "yes" if c.fits else "NO"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows)


def _short(seconds: float) -> str:
    return "0" if seconds == 0 else f"{seconds:.3g}"


def explain(result: SearchResult) -> str:
    rejections: Rejections = result.rejections
    fitting = sum(c.fits for c in result.candidates)
    lines = [f"{result.considered} layouts considered, {fitting} fit, {sum(rejections.counts.values())} rejected:"]
    for kind, count in rejections.counts.most_common():
        lines.append(f"  {count:6d}  {kind}")
        lines.extend(f"          e.g. {example}" for example in rejections.examples[kind])
    return "\n".join(lines)


ORDER_MARGIN = 0.05  # measured differences below this are within the sources' run-to-run noise


def published_table() -> str:
    """Every published run, reported vs predicted tokens/s per GPU with the planner's constants (in
    sample for the fit sources: `ndtrain plan --validate` gives the leave-one-source-out figures)."""
    rows = [("#", "source", "row", "gpu", "profile", "layout", "reported", "predicted", "error", "role")]
    for index, run in enumerate(RUNS):
        lay = run.layout
        rows.append((str(index), run.source.key, run.name, run.gpu, run.kernels.name,
                     f"{lay.label()} B={run.global_batch}", f"{run.reported:.1f}", f"{run.predicted():.1f}",
                     f"{100 * run.error():+.1f}%", "held out" if run.source.held_out else "fit"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    for name, chosen in (("fit sources, in sample", False), ("held out", True)):
        errors = [abs(run.error()) for run in RUNS if run.source.held_out == chosen]
        lines.append(f"{name}: {len(errors)} rows, median |error| {100 * statistics.median(errors):.1f} %, "
                     f"worst {100 * max(errors):.1f} %")
    for source, runs in ORDERINGS:
        pairs = ordering_pairs(runs)
        lines.append(f"ordering, {source}: {sum(ok for _, _, ok in pairs)} of {len(pairs)} pairs reproduced")
    return "\n".join(lines)


def ordering_pairs(runs: Sequence[PublishedRun], efficiency: GpuEfficiency | None = None
                   ) -> list[tuple[PublishedRun, PublishedRun, bool]]:
    """(measured faster, measured slower, whether the planner predicts it faster) for every pair of
    compared runs whose measured throughputs differ by more than ORDER_MARGIN."""
    pairs = []
    for first, second in itertools.combinations(runs, 2):
        faster, slower = (first, second) if first.reported >= second.reported else (second, first)
        if faster.reported > (1 + ORDER_MARGIN) * slower.reported:
            pairs.append((faster, slower, faster.predicted(efficiency) > slower.predicted(efficiency)))
    return pairs


def terms(candidate: Candidate, model: ModelSpec, cluster: Cluster) -> str:
    """The best layout's time, term by term (what `--explain` shows beside the rejections)."""
    lay, tm, hw = candidate.layout, candidate.timing, cluster.hardware
    lines = [f"time of one step of the best layout ({lay.label()}), by term:"]
    if hw.cpu is None:
        eff = hw.efficiency
        layer = gpu_compute.layer_terms(model, lay, hw)
        gpu = gpu_compute.compute(model, lay, hw)
        gemm_rate = (f"η_fp8 = {eff.fp8_matmul} of {hw.fp8_peak_flops / 1e12:.4g} FP8" if hw.kernels.fp8
                     else f"η_mm = {eff.gemm(hw.tensor_cores)} of {hw.peak_flops / 1e12:.4g}")
        per_layer, scores = gpu_compute.element_bytes(model, lay, hw)
        lines.append(f"  kernel profile {hw.kernels.name}: {hw.kernels.stack}")
        lines.append(f"  one layer forward, one rank: gemm {_ms(layer.gemm)} (arithmetic at {gemm_rate} TFLOP/s + "
                     f"operand traffic at {hw.hbm_bandwidth / 1e12:.4g} TB/s), "
                     f"waves {_ms(layer.waves)} ({_fills(model, lay, hw)}), "
                     f"attention {_ms(layer.attention)} (η_attn = {eff.flash(hw.kernels.attention)} for "
                     f"{hw.kernels.attention} flash kernels, η_mm for dense), "
                     f"element-wise {_ms(layer.element)} ({(per_layer + scores) / 1e6:.1f} MB the profile's kernels "
                     f"move at η_ew = {eff.elementwise} of HBM)")
        lines.append(f"  one layer backward {_ms(gpu.layer_b)} (2 × forward, term by term); recompute adds "
                     f"{_ms(gpu.recompute)} per layer backward ({lay.recompute})")
        lines.append(f"  data-parallel gradients reduced at {hw.precision.grad_bytes} bytes per value; overlapped "
                     f"communication costs φ = {eff.overlap_cost} of its time in the compute it runs beside")
    for part in TIME_PARTS:
        lines.append(f"  {part:10s} {_ms(getattr(tm, part))}")
    lines.append(f"  {'step':10s} {_ms(tm.step)}")
    return "\n".join(lines)


def _fills(model: ModelSpec, lay: Layout, hw: Hardware) -> str:
    """How full the last wave of each forward product is: tiles of the stated size over the GPU's SMs."""
    tile = hw.efficiency.tile
    if tile is None or hw.sms == 0:
        return "no wave quantization"
    tokens = lay.mbs * model.seq / lay.cp
    fills = [gpu_compute.wave_fill(tokens, cols, hw, hw.efficiency)
             for _, cols in gpu_compute.layer_gemm_shapes(model, lay.tp)]
    return (f"{tile[0]}×{tile[1]} tiles on {hw.sms} SMs fill the QKV/out/MLP-in/MLP-out products' waves to "
            + "/".join(f"{100 * fill:.0f}" for fill in fills) + " %")


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.3f} ms"
