"""Engine on 4 ranks under composed layouts with the options the layout matrix leaves out (sequence
parallel, bf16, selective and full recompute): training equals single-process AdamW with clipping;
the gathered checkpoint state has the original names and shapes; evaluation equals the
single-process loss. The plain factorizations × ZeRO stage × pipeline schedule are
tests/test_layout_matrix.py's (which asserts the same, in float64 at 1e-5 too).

One spawn (a module fixture) runs every layout on the same 4 processes (the groups of each layout
are built in turn on the one world); each layout is then its own test case, so one failing layout
hides none of the others. The parent trains the single-process reference on the whole global batch.

Runs and reference are float64 (but the bf16 layout, whose weights are not compared): in fp32 the
CPU kernels' summation order, amplified by AdamW on near-cancelling gradients, alone reached the
1e-5 bound (see tests/test_zero.py); in float64 that noise is ~1e-13 and the bound measures the layouts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ndtrain.config import ParallelConfig
from ndtrain.engine import Engine
from ndtrain.errors import UserError
from ndtrain.dist.mesh import init
from ndtrain.models.llama import build_model
from ndtrain.parallel.data.param_groups import no_decay_for_vectors
from tests.helpers.layouts import BF16_LOSS_TOLERANCE, DTYPE, GLOBAL_BATCH, MAX_NORM, MODEL, SEQ, STEPS, State, adamw, batch
from tests.helpers.models import shard
from tests.helpers.parity import assert_params_close
from tests.helpers.reference import Reference, decay_groups, train_reference
from tests.helpers.runner import case_result, init_method, run_distributed, run_each

LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {  # name → (layout, micro-batches per rank per step)
    "dp2-tp2-sp-zero1": (dict(dp=2, tp=2, sequence_parallel=True, zero=1), 2),
    "dp2-pp2-bf16": (dict(dp=2, pp=2, precision="bf16", comm_dtype="bf16"), 2),
    "dp2-cp2-selective": (dict(dp=2, cp=2, recompute="selective"), 1),
    "pp4-zb-full": (dict(dp=1, pp=4, pp_schedule="zb", recompute="full"), 4),
}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference(one_thread: None) -> tuple[Reference, float]:
    """Single process, whole global batch, AdamW with clipping; then the loss of the evaluation batch."""
    model = build_model(MODEL, seed=0).to(DTYPE)
    ref = train_reference(model, adamw(decay_groups(model)), map(batch, range(STEPS)), clip=MAX_NORM)
    with torch.no_grad():
        val = model(*batch(STEPS)).item()
    return ref, val


def _train(name: str) -> dict[str, Any]:
    layout, accumulation = LAYOUTS[name]
    parallel = ParallelConfig(**layout)
    ctx = init(parallel, init_method=init_method())
    dtype = torch.float32 if layout.get("precision") == "bf16" else DTYPE
    engine = Engine(lambda: build_model(MODEL, seed=0).to(dtype), adamw, ctx, parallel, group_fn=no_decay_for_vectors, grad_clip=MAX_NORM)
    dp, rank = ctx.size("dp"), ctx.coord("dp")
    losses = [engine.train_step(shard(batch(step), rank, dp, accumulation)).loss for step in range(STEPS)]
    evaluation = engine.evaluate(shard(batch(STEPS), rank, dp))
    val, tokens = evaluation.loss, evaluation.tokens
    return {"losses": losses, "val": val, "tokens": tokens, "state": engine.full_state_dict()}


def _train_layouts() -> dict[str, Any]:
    """Every layout in turn on the same 4 processes (the groups of each built on the one world)."""
    return run_each(_train, LAYOUTS)


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_train_layouts, 4, timeout=300)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_process(name: str, runs: list[dict[str, Any]], reference: tuple[Reference, float]) -> None:
    ref, ref_val = reference
    merged: State = {}
    bf16 = "bf16" in name
    for run in case_result(runs, name):
        assert run["losses"] == pytest.approx(ref.losses, rel=BF16_LOSS_TOLERANCE if bf16 else 1e-5)
        assert run["val"] == pytest.approx(ref_val, rel=BF16_LOSS_TOLERANCE if bf16 else 1e-5)
        assert run["tokens"] == GLOBAL_BATCH * SEQ
        for key, value in run["state"].items():
            assert value.shape == ref.state[key].shape, key
            merged[key] = value
    assert merged.keys() == ref.state.keys()  # the stages together hold the whole model
    if bf16:
        return
    assert {t.dtype for t in merged.values()} == {DTYPE}  # no layout narrowed the float64 model
    assert_params_close(merged, ref.state, 1e-5, name)


@pytest.mark.parametrize(
    "layout, message",
    [
        (dict(tp=1, sequence_parallel=True), "sequence_parallel=true needs tp > 1"),
    ],
)
def test_unsupported_combinations_are_refused(layout: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match=message):
        ParallelConfig(**layout).validate()
