"""ZeRO's optimizer tensors are cut every `OPTIMIZER_RUN` elements, and the update is unchanged by it.

Two gloo processes train a 2048 × 1100 matrix (2,252,800 elements: 1,126,400 per rank, more
than one `OPTIMIZER_RUN`) with ZeRO-1 (through gloo, and through the shared-memory ring of one
host, dist/host_stream.py, in 5 rounds of at most `PIECE` elements per rank) and ZeRO-2 in float64
through `ZeroOptimizer` and AdamW.
Each rank's inner optimizer must see segments of at most `OPTIMIZER_RUN` elements that tile its
range without gaps, and after three steps the matrix must equal single-process AdamW on the
whole batch (relative error ≤ 1e-12: an elementwise update is the same however its tensor is cut).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

from ndtrain.config import ParallelConfig
from ndtrain.dist.host_slots import host_slots_supported
from ndtrain.dist.host_stream import PIECE
from ndtrain.dist.mesh import init
from ndtrain.parallel.data.flat_layout import OPTIMIZER_RUN
from ndtrain.parallel.data.zero1_gradients import Zero1DataParallel
from ndtrain.parallel.data.zero1_optimizer import ZeroOptimizer
from ndtrain.parallel.data.zero2_gradients import Zero2DataParallel
from tests.helpers.counts import counted_since
from tests.helpers.parity import assert_params_close
from tests.helpers.runner import init_method, run_distributed

SHAPE = (2048, 1100)
STEPS = 3
pytestmark = pytest.mark.usefixtures("one_thread")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(SHAPE[1], SHAPE[0], bias=False).double()


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, SHAPE[1], generator=torch.Generator().manual_seed(step), dtype=torch.float64)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _train() -> dict[str, Any]:
    ctx = init(ParallelConfig(dp=2), init_method=init_method())
    out: dict[str, Any] = {}
    wrappers = {"zero1": Zero1DataParallel, "zero1-ring": functools.partial(Zero1DataParallel, host_slots=True),
                "zero2": Zero2DataParallel}
    for name, wrapper in wrappers.items():
        model = wrapper(_model(), ctx)
        optimizer = ZeroOptimizer(model, ctx, _adamw)
        segments = [p for group in optimizer.param_groups for p in group["params"]]
        cuts = [(a, b) for s in optimizer._shards for a, b, *_ in s.segments]
        before = ctx.comm.stats.snapshot()
        for step in range(STEPS):
            x = _batch(step).chunk(2)[ctx.rank]
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=step % 2 == 0)
        after = ctx.comm.stats.snapshot()
        out[name] = {"sizes": [p.numel() for p in segments], "cuts": cuts,
                     "shm": {k: v["calls"] for k, v in counted_since(before, after).items() if "_shm" in k},
                     "range": (optimizer._shards[0].lo, optimizer._shards[0].hi),
                     "weight": model.module.weight.detach().clone()}
    return out


def _reference() -> torch.Tensor:
    model = _model()
    optimizer = _adamw(model.parameters())
    for step in range(STEPS):
        x = _batch(step)
        # the mean over both ranks' halves of the batch: what DDP's averaged gradient is
        sum(model(half).square().mean() for half in x.chunk(2)).div(2).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.weight.detach().clone()


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_train, 2, timeout=180)


@pytest.mark.parametrize("name", ["zero1", "zero1-ring", "zero2"])
def test_optimizer_segments_are_cut_and_the_update_is_unchanged(results: list[dict[str, Any]], name: str) -> None:
    expected = _reference()
    for rank, result in enumerate(results):
        run = result[name]
        assert max(run["sizes"]) == OPTIMIZER_RUN and len(run["sizes"]) == 2, run["sizes"]
        lo, hi = run["range"]
        assert run["cuts"][0][0] == lo and run["cuts"][-1][1] == hi
        assert all(b0 == a1 for (_, b0), (a1, _) in zip(run["cuts"], run["cuts"][1:])), run["cuts"]
        assert_params_close({"weight": run["weight"]}, {"weight": expected}, 1e-12, f"{name} rank {rank}")
        rounds = -(-(SHAPE[0] * SHAPE[1] // 2) // PIECE)  # 5 rounds of one rank's range per collective
        ring = {"reduce_scatter_shm/dp_cp": STEPS * rounds, "all_gather_shm/dp_cp": STEPS * rounds}
        assert run["shm"] == (ring if name == "zero1-ring" and host_slots_supported() else {}), run["shm"]
