"""Engine on 4 ranks under composed layouts (tp, sp, pp schedules, cp, recompute, ZeRO 1/2/3): training
equals single-process AdamW with clipping; the gathered checkpoint state has the original names
and shapes; evaluation equals the single-process loss.

One spawn runs every layout on the same 4 processes (the groups of each layout are built in turn
on the one world); the parent trains the single-process reference on the whole global batch.

Runs and reference are float64 (but the bf16 layout, whose weights are not compared): in fp32 the
CPU kernels' summation order, amplified by AdamW on near-cancelling gradients, alone reached the
1e-5 bound (see tests/test_zero.py); in float64 that noise is ~1e-13 and the bound measures the layouts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ndtrain.config import ModelConfig, ParallelConfig
from ndtrain.engine import Engine
from ndtrain.errors import UserError
from ndtrain.mesh import init
from ndtrain.models.llama import build_model
from ndtrain.parallel.zero1_optimizer import no_decay_for_vectors
from tests.distributed import init_method, run_distributed
from tests.parity import assert_close_params

STEPS = 3
GLOBAL_BATCH = 8
SEQ = 16
LR = 1e-3
EPS = 1e-6  # see test_fsdp: with 1e-8 Adam turns 1e-7 summation-order noise on near-zero gradients into 1e-5 steps
MAX_NORM = 0.3  # below the model's gradient norms: clipping is exercised
MODEL = ModelConfig(preset="tiny", dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, seq_len=SEQ)

DTYPE = torch.float64  # of the reference and every layout but bf16 (see the docstring)
BF16_LOSS_TOLERANCE = 2e-2  # as test_precision: 10× bf16's rounding of the loss; weights are not compared

# (name, layout, micro-batches per rank per step)
LAYOUTS: list[tuple[str, dict[str, Any], int]] = [
    ("dp2-tp2-sp-zero1", dict(dp=2, tp=2, sequence_parallel=True, zero=1), 2),
    ("dp2-pp2-1f1b", dict(dp=2, pp=2, pp_schedule="1f1b"), 2),
    ("dp2-pp2-gpipe-zero1", dict(dp=2, pp=2, pp_schedule="gpipe", zero=1), 2),
    ("dp2-pp2-bf16", dict(dp=2, pp=2, precision="bf16", comm_dtype="bf16"), 2),
    ("dp2-cp2-selective", dict(dp=2, cp=2, recompute="selective"), 1),
    ("dp2-cp2-zero2", dict(dp=2, cp=2, zero=2), 2),
    ("dp2-cp2-zero3", dict(dp=2, cp=2, zero=3), 1),
    ("tp2-pp2-interleaved", dict(dp=1, tp=2, pp=2, pp_schedule="interleaved", pp_virtual=2), 4),
    ("pp4-zb-full", dict(dp=1, pp=4, pp_schedule="zb", recompute="full"), 4),
]

State = dict[str, torch.Tensor]
pytestmark = pytest.mark.usefixtures("one_thread")


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def adamw(groups: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR, eps=EPS, weight_decay=0.1)


def reference() -> tuple[State, list[float], float]:
    model = build_model(MODEL, seed=0).to(DTYPE)
    groups = [{"params": [p for p in model.parameters() if p.ndim >= 2]},
              {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    opt = adamw(groups)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        x, y = batch(STEPS)
        val = model(x, y).item()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, val


def train_layouts() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, layout, accumulation in LAYOUTS:
        ctx = init(ParallelConfig(**layout), init_method=init_method())
        dtype = torch.float32 if layout.get("precision") == "bf16" else DTYPE
        engine = Engine(lambda: build_model(MODEL, seed=0).to(dtype), adamw, ctx, group_fn=no_decay_for_vectors, grad_clip=MAX_NORM)
        dp, rank = ctx.size("dp"), ctx.coord("dp")
        losses = []
        for step in range(STEPS):
            x, y = batch(step)
            x, y = x.chunk(dp)[rank], y.chunk(dp)[rank]
            losses.append(engine.train_step(list(zip(x.chunk(accumulation), y.chunk(accumulation)))).loss)
        x, y = batch(STEPS)
        val, tokens = engine.evaluate([(x.chunk(dp)[rank], y.chunk(dp)[rank])])
        state = engine.full_state_dict()
        out[name] = {"losses": losses, "val": val, "tokens": tokens, "state": state}
    return out


def test_composed_layouts_train_like_one_process() -> None:
    ref_state, ref_losses, ref_val = reference()
    results = run_distributed(train_layouts, 4, timeout=300)
    for name, _, _ in LAYOUTS:
        merged: State = {}
        bf16 = "bf16" in name
        for rank_result in results:
            run = rank_result[name]
            assert run["losses"] == pytest.approx(ref_losses, rel=BF16_LOSS_TOLERANCE if bf16 else 1e-5), name
            assert run["val"] == pytest.approx(ref_val, rel=BF16_LOSS_TOLERANCE if bf16 else 1e-5), name
            assert run["tokens"] == GLOBAL_BATCH * SEQ, name
            for key, value in run["state"].items():
                assert value.shape == ref_state[key].shape, (name, key)
                merged[key] = value
        assert merged.keys() == ref_state.keys(), name  # the stages together hold the whole model
        if bf16:
            continue
        assert {t.dtype for t in merged.values()} == {DTYPE}, name  # no layout narrowed the float64 model
        assert_close_params(merged, ref_state, 1e-5, name)


@pytest.mark.parametrize(
    "layout, message",
    [
        (dict(tp=1, sequence_parallel=True), "sequence_parallel=true needs tp > 1"),
        (dict(tp=2, zero=3), "parallel.zero=3 with tp > 1 is not supported"),
    ],
)
def test_unsupported_combinations_are_refused(layout: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match=message):
        ParallelConfig(**layout).validate()
