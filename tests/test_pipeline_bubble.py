"""Pipeline timeline on gloo: measured bubble fraction vs theory, live activations vs theory,
Chrome trace and PNG written.

The stages are a chain of `Sleepy` blocks whose forward and backward each sleep a fixed time:
compute cost dominates, is predictable and needs no CPU, so p processes on 2 shared cores still
show the schedule's own bubble. Fractions are compared, never times.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.config import ParallelConfig
from ndtrain.dist.mesh import init
from ndtrain.parallel.pipeline import Timeline, bubble_fraction, run_pipeline, split_model, write_chrome_trace, write_png
from ndtrain.parallel.pipeline import schedules
from ndtrain.parallel.pipeline.schedules import compute_actions
from tests.helpers.runner import init_method, run_distributed

P, M = 4, 8
UNIT_S = 0.2  # sleep per block and pass, at v = 1: large against the gaps between passes on a busy machine
NAIVE_UNIT_S = 0.05  # naive's bubble (p−1)/p is large: its tolerance is too


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.seconds = seconds
        time.sleep(seconds)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, w = ctx.saved_tensors
        time.sleep(ctx.seconds)
        return grad * w, (grad * x).sum().reshape(w.shape), None


class Sleepy(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.w, self.seconds)


def theory(schedule: str, p: int, m: int, v: int) -> float:
    """The schedule's bubble with these stages' costs: every pass one sleep (a full backward B,
    and each of I and W, re-run the block's backward), except zb's I on stage 0, which has no
    input gradient to compute and costs nothing."""
    def cost(kind: str, stage: int) -> float:
        return 0.0 if kind == "I" and stage == 0 else 1.0 / v

    return schedules.bubble_fraction(schedules.simulate(compute_actions(schedule, p, m, v), p, v, cost))


def closed_form(schedule: str, p: int, m: int, v: int) -> float:
    """The textbook figure with equal pass costs."""
    if schedule == "naive":
        return (p - 1) / p
    if schedule == "zb":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / v / (m + (p - 1) / v)


def theory_live(schedule: str, p: int, m: int, v: int) -> list[int]:
    """Most micro-batches holding activations at once per rank: F adds one, B / W frees one."""
    out = []
    for actions in compute_actions(schedule, p, m, v):
        live = peak = 0
        for a in actions:
            live += 1 if a.kind == "F" else -1 if a.kind in ("B", "W") else 0
            peak = max(peak, live)
        out.append(peak)
    return out


CASES = [("naive", 1), ("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)]


def _worker(out_dir: str) -> dict[str, Any]:
    ctx = init(ParallelConfig(pp=P), init_method=init_method())
    x = torch.ones(1, requires_grad=True)  # the first backward into a Python Function imports for seconds
    torch.autograd.backward(Sleepy(0.0)(x), torch.ones(1))
    results = {}
    for schedule, v in CASES:
        unit = NAIVE_UNIT_S if schedule == "naive" else UNIT_S
        model = nn.Sequential(*(Sleepy(unit / v) for _ in range(P * v)))
        stages = split_model(model, ctx, virtual=v, loss_fn=lambda y, t: F.mse_loss(y, t))
        batches = [(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(M)]
        timeline = Timeline()
        run_pipeline(stages, batches, ctx, schedule, timeline)
        ranks = timeline.gather(ctx)
        if ctx.rank == 0:
            write_chrome_trace(ranks, Path(out_dir) / f"{schedule}.json")
            write_png(ranks, Path(out_dir) / f"{schedule}.png", title=schedule)
        results[schedule] = (bubble_fraction(ranks), timeline.peak_live, len(ranks[ctx.rank]))
    return results


@pytest.mark.slow  # 30 s of sleeps; the schedules' parity runs in CI (test_pipeline_parity.py, test_pipeline_schedules.py)
# and so does the pipeline timeline of a real run (test_report.py)
def test_bubble_and_live_activations_follow_theory(tmp_path: Path) -> None:
    results = run_distributed(_worker, P, str(tmp_path))
    print({s: (round(results[0][s][0], 3), round(theory(s, P, M, v), 3)) for s, v in CASES})
    for schedule, v in CASES:
        measured = results[0][schedule][0]
        assert all(r[schedule][0] == measured for r in results)  # gathered: the same on every rank
        want = theory(schedule, P, M, v)
        assert abs(measured - want) <= 0.25 * want, f"{schedule}: bubble {measured:.3f} vs theory {want:.3f}"
        live = [r[schedule][1] for r in results]
        assert live == theory_live(schedule, P, M, v), f"{schedule}: live activations {live}"
        trace = json.loads((tmp_path / f"{schedule}.json").read_text())
        compute = [e for e in trace["traceEvents"] if e.get("cat") in ("F", "B", "I", "W")]
        assert len(compute) == P * M * v * (3 if schedule == "zb" else 2)
        assert (tmp_path / f"{schedule}.png").stat().st_size > 0
    for schedule, v in CASES[:-1]:  # zb: stage 0 has no input gradient, so its I is free
        assert theory(schedule, P, M, v) == pytest.approx(closed_form(schedule, P, M, v))
    assert theory("zb", P, M, 1) < closed_form("1f1b", P, M, 1)
    assert [r["gpipe"][1] for r in results] == [M] * P
    assert [r["1f1b"][1] for r in results] == [P - r for r in range(P)]
    assert max(r["zb"][1] for r in results) <= P
