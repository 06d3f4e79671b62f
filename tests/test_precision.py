"""Mixed precision through the engine at every ZeRO stage: bf16 tracks the fp32 loss curve (with the
masters on torch's fused AdamW too, `parallel.flat_adamw`); fp16 skips a step whose gradients overflow (forced), leaves the weights untouched, halves the loss scale, recovers
and grows the scale again; the loss scaler's state survives a round trip.

Tolerance for bf16: bf16 keeps 8 significant bits (relative rounding 2^-9 ≈ 0.2% per operation);
with fp32 masters, fp32 optimizer state and fp32 loss/softmax the rounding does not accumulate in
the weights, so the loss curve should stay within about 1% of fp32's (observed: ≤ 0.5% on this
model). We allow 2% per step: 10× bf16's rounding, while a broken master update, a missing
gradient shard or an unscaled gradient moves the curve by far more than that (the fp32 loss
falls by more than half over the run, so a stalled model fails at once).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ndtrain.config import ParallelConfig
from ndtrain.engine import Engine
from ndtrain.dist.mesh import ParallelContext, init
from ndtrain.parallel.data.zero3_parameters import FullyShardedDataParallel
from ndtrain.parallel.precision import LossScaler, master_dtype, reduction_dtype
from ndtrain.parallel.data.zero2_gradients import Zero2DataParallel
from tests.helpers.models import batch, make_llama
from tests.helpers.runner import init_method, run_distributed

STEPS = 12
LR = 1e-2
BF16_TOLERANCE = 0.02


class Spiky(nn.Module):
    """The tiny Llama whose loss is multiplied by `gain` (1 normally): a huge gain forces fp16 overflow."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_llama()
        self.gain = 1.0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.inner(x, y) * self.gain


def adamw(groups: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR)


def _batches(ctx: ParallelContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = batch(0)  # the same batch every step: the loss falls steadily
    return [(x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank])]


def _curve(ctx: ParallelContext, zero: int, precision: str, flat_adamw: bool = False) -> list[float]:
    parallel = ParallelConfig(zero=zero, precision=precision, bucket_mb=0.01, flat_adamw=flat_adamw)
    engine = Engine(make_llama, adamw, ctx, parallel, grad_clip=1.0)
    if flat_adamw:  # the fp32 masters are stepped by torch's fused kernel
        assert type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__ == "FusedAdamW"
    return [engine.train_step(_batches(ctx)).loss for _ in range(STEPS)]


def _overflow(ctx: ParallelContext, zero: int, flat_adamw: bool = False) -> dict[str, Any]:
    model: Spiky | None = None

    def build() -> Spiky:
        nonlocal model
        model = Spiky()
        return model

    parallel = ParallelConfig(zero=zero, precision="fp16", bucket_mb=0.01, fsdp_wrap="inner.layers.*", flat_adamw=flat_adamw)
    engine = Engine(build, adamw, ctx, parallel, loss_scaler=LossScaler(ctx, init_scale=2.0**10, growth_interval=2))
    assert model is not None
    out: dict[str, Any] = {"skipped": [], "scale": [], "loss": [], "unchanged": []}
    for step in range(6):
        model.gain = 1e30 if step == 2 else 1.0  # step 2: gradients overflow in fp16 (on every rank)
        before = engine.full_state_dict()
        result = engine.train_step(_batches(ctx))
        after = engine.full_state_dict()
        out["skipped"].append(result.skipped)
        out["scale"].append(result.loss_scale)
        out["loss"].append(result.loss)
        out["unchanged"].append(all(torch.equal(before[k], after[k]) for k in before))
    out["final_scale"] = engine.scaler.scale  # type: ignore[union-attr]
    restored = LossScaler(ctx)
    restored.load_state_dict(engine.extra_state()["loss_scaler"])
    out["restored"] = restored.state_dict() == engine.scaler.state_dict()  # type: ignore[union-attr]
    out["skipped_steps"] = engine.scaler.skipped_steps  # type: ignore[union-attr]
    return out


def _suite() -> dict[str, Any]:
    ctx = init(ParallelConfig(), init_method=init_method())
    return {
        "curves": {(zero, p): _curve(ctx, zero, p) for zero in (0, 1, 2, 3) for p in ("fp32", "bf16")},
        "fused_curves": {zero: _curve(ctx, zero, "bf16", flat_adamw=True) for zero in (0, 1, 3)},
        "overflow": {**{zero: _overflow(ctx, zero) for zero in (0, 2, 3)}, "3, fused": _overflow(ctx, 3, flat_adamw=True)},
    }


def test_bf16_tracks_fp32_and_fp16_skips_overflowing_steps() -> None:
    out = run_distributed(_suite, 2)
    for o in out:
        for zero in (0, 1, 2, 3):
            fp32, bf16 = o["curves"][zero, "fp32"], o["curves"][zero, "bf16"]
            assert fp32[-1] < 0.5 * fp32[0], fp32  # the run learns
            assert bf16 != fp32  # bf16 really computed in bf16
            for a, b in zip(fp32, bf16):
                assert abs(a - b) <= BF16_TOLERANCE * a, (zero, fp32, bf16)
            if zero in o["fused_curves"]:  # parallel.flat_adamw: the masters on the fused kernel
                fused = o["fused_curves"][zero]
                assert all(abs(a - b) <= BF16_TOLERANCE * a for a, b in zip(fp32, fused)), (zero, fp32, fused)
        for zero, r in o["overflow"].items():
            assert r["skipped"] == [False, False, True, False, False, False], (zero, r)
            assert r["unchanged"] == [False, False, True, False, False, False], (zero, r)
            # 2 good steps double the scale; the overflow halves it; 2 good steps double it again
            assert r["scale"] == [2.0**10, 2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**11], (zero, r["scale"])
            assert r["final_scale"] == 2.0**11
            assert r["loss"][5] < r["loss"][0]  # training goes on after the skip
            assert r["skipped_steps"] == 1 and r["restored"]


def test_float64_models_are_never_narrowed() -> None:
    """Masters and shards are at least fp32 and never below the parameters; an fp32 reduction of
    float64 gradients runs in float64, a bf16 one as asked (single process: the wrappers' buffers)."""
    assert [master_dtype(d) for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64)] == [
        torch.float32, torch.float32, torch.float32, torch.float64]
    assert reduction_dtype(torch.float32, torch.bfloat16) == torch.float32
    assert reduction_dtype(torch.float32, torch.float32) == torch.float32
    assert reduction_dtype(torch.float32, torch.float64) == torch.float64
    assert reduction_dtype(torch.bfloat16, torch.float64) == torch.bfloat16
    ctx = init(ParallelConfig())
    zero2 = Zero2DataParallel(make_llama(torch.float64), ctx)
    assert {(b.shard.dtype, b.comm_dtype) for b in zero2._buckets} == {(torch.float64, torch.float64)}
    fsdp = FullyShardedDataParallel(make_llama(torch.float64), ctx)
    assert {(u.shard.dtype, u.param_dtype, u.reduce_dtype) for u in fsdp.units} == {(torch.float64,) * 3}
    mixed = FullyShardedDataParallel(make_llama(), ctx, param_dtype=torch.bfloat16)
    assert {(u.shard.dtype, u.param_dtype, u.reduce_dtype) for u in mixed.units} == {
        (torch.float32, torch.bfloat16, torch.float32)}
    plain = FullyShardedDataParallel(make_llama(), ctx)
    assert {(u.shard.dtype, u.param_dtype, u.reduce_dtype) for u in plain.units} == {(torch.float32,) * 3}
