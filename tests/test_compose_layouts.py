"""Layouts that compose strategies refused before: pipeline × context parallel (ring attention
inside each stage, sequence shards flowing between stages), fp16 with pipeline parallel (the loss
scaler's inf/NaN check over the whole world), interleaved stages with ZeRO-1 and mixed precision,
ZeRO-3 per pipeline stage, ZeRO-2 with tensor and pipeline parallel.

One spawn of 4 processes runs the FAST layouts in turn (one per lifted refusal; SLOW, the rest,
is a second spawn marked slow), with the model, batches and optimizer of tests/test_engine_layouts.py:
parameters after several AdamW steps with clipping equal the single-process run (float64, relative
error ≤ 1e-5), as do the loss curve, the global gradient norm, the evaluation loss and the token
count; sharded-gradient layouts reduce-scatter every unit or bucket once per micro-batch.
Mixed-precision layouts compare the loss curve and norms only (bf16/fp16 rounding: test_precision's
2% bound). The fp16 overflow is forced on the first pipeline stage only (an inf gradient hook), so
only a world-wide check makes the last stage skip too.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from ndtrain.config import ParallelConfig
from ndtrain.engine import Engine
from ndtrain.dist.mesh import init
from ndtrain.models.llama import build_model
from ndtrain.parallel.precision import LossScaler
from ndtrain.parallel.data.param_groups import no_decay_for_vectors
from tests.helpers.layouts import BF16_LOSS_TOLERANCE, DTYPE, GLOBAL_BATCH, MAX_NORM, MODEL, SEQ, STEPS, State, adamw, batch
from tests.helpers.parity import assert_params_close
from tests.helpers.runner import init_method, run_distributed

Layout = tuple[str, dict[str, Any], int]  # (name, layout, micro-batches per rank per step)
# float64 unless the name says bf16/fp16; one layout per lifted refusal runs in CI, the rest is slow
FAST: list[Layout] = [
    ("dp2-pp2-fp16", dict(dp=2, pp=2, precision="fp16"), 2),
    ("dp2-pp2-vpp2-zero1", dict(dp=2, pp=2, pp_schedule="interleaved", pp_virtual=2, zero=1), 2),
    ("dp2-pp2-1f1b-zero3", dict(dp=2, pp=2, pp_schedule="1f1b", zero=3), 2),
    ("dp2-tp2-sp-zero2", dict(dp=2, tp=2, sequence_parallel=True, zero=2), 2),
]
SLOW: list[Layout] = [
    ("pp2-cp2-1f1b", dict(dp=1, pp=2, cp=2, pp_schedule="1f1b"), 2),  # in CI through tests/test_layout_matrix.py
    ("pp2-cp2-zb-zero1", dict(dp=1, pp=2, cp=2, pp_schedule="zb", zero=1), 2),
    ("pp2-cp2-vpp2-zero1", dict(dp=1, pp=2, cp=2, pp_schedule="interleaved", pp_virtual=2, zero=1), 2),
    ("dp2-pp2-vpp2-bf16", dict(dp=2, pp=2, pp_schedule="interleaved", pp_virtual=2, precision="bf16"), 2),
    ("dp2-pp2-vpp2-zero1-fp16", dict(dp=2, pp=2, pp_schedule="interleaved", pp_virtual=2, zero=1, precision="fp16"), 2),
    ("dp2-pp2-gpipe-zero3-keep", dict(dp=2, pp=2, pp_schedule="gpipe", zero=3, reshard_after_forward=False), 4),
    ("cp2-pp2-1f1b-zero3", dict(dp=1, cp=2, pp=2, pp_schedule="1f1b", zero=3), 2),
    ("dp2-pp2-1f1b-zero2", dict(dp=2, pp=2, pp_schedule="1f1b", zero=2), 2),
    ("tp2-pp2-gpipe-zero2", dict(dp=1, tp=2, pp=2, pp_schedule="gpipe", zero=2), 2),
]
OVERFLOW_STEP = 2
LOW_PRECISION = ("bf16", "fp16")
pytestmark = pytest.mark.usefixtures("one_thread")


def _train(name: str, layout: dict[str, Any], accumulation: int) -> dict[str, Any]:
    parallel = ParallelConfig(**layout)
    ctx = init(parallel, init_method=init_method())
    dtype = torch.float32 if layout.get("precision", "fp32") in LOW_PRECISION else DTYPE
    engine = Engine(lambda: build_model(MODEL, seed=0).to(dtype), adamw, ctx, parallel, group_fn=no_decay_for_vectors,
                    grad_clip=MAX_NORM)
    dp, rank = ctx.size("dp"), ctx.coord("dp")
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x.chunk(dp)[rank], y.chunk(dp)[rank]
        before = _reduce_scatters(ctx)
        result = engine.train_step(list(zip(x.chunk(accumulation), y.chunk(accumulation))))
        assert not result.skipped, (name, step)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    x, y = batch(STEPS)
    evaluation = engine.evaluate([(x.chunk(dp)[rank], y.chunk(dp)[rank])])
    val, tokens = evaluation.loss, evaluation.tokens
    return {"losses": losses, "norms": norms, "val": val, "tokens": tokens, "state": engine.full_state_dict(),
            "units": len(getattr(engine.wrapped, "units", None) or getattr(engine.wrapped, "buckets", ())),
            "reduce_scatters": _reduce_scatters(ctx) - before}  # in the last step


def _reduce_scatters(ctx: Any) -> int:
    """Reduce-scatters issued so far over dp × cp, through the backend or shared-memory slots (ZeRO-2 on
    one host); sequence parallel's over tp are not counted."""
    counts, axis = ctx.comm.stats.snapshot(), ctx.group("dp_cp").name
    return sum(counts.get(f"{op}/{axis}", {}).get("calls", 0) for op in ("reduce_scatter", "reduce_scatter_shm"))


def _overflow() -> dict[str, Any]:
    """fp16, dp=2 × pp=2, ZeRO-1: step OVERFLOW_STEP's gradients are made inf on the first stage only."""
    parallel = ParallelConfig(dp=2, pp=2, precision="fp16", zero=1)
    ctx = init(parallel, init_method=init_method())
    engine = Engine(lambda: build_model(MODEL, seed=0), adamw, ctx, parallel, group_fn=no_decay_for_vectors, grad_clip=MAX_NORM,
                    loss_scaler=LossScaler(ctx, init_scale=2.0**10, growth_interval=2))
    gain = [1.0]
    if ctx.coord("pp") == 0:
        engine.model.tok_embeddings.weight.register_hook(lambda g: g * gain[0])
    out: dict[str, Any] = {"skipped": [], "scale": [], "unchanged": [], "finite_norm": []}
    dp, rank = ctx.size("dp"), ctx.coord("dp")
    for step in range(4):
        gain[0] = math.inf if step == OVERFLOW_STEP else 1.0
        x, y = batch(step)
        before = engine.full_state_dict()
        result = engine.train_step(list(zip(x.chunk(dp)[rank].chunk(2), y.chunk(dp)[rank].chunk(2))))
        after = engine.full_state_dict()
        out["skipped"].append(result.skipped)
        out["scale"].append(result.loss_scale)
        out["finite_norm"].append(math.isfinite(result.grad_norm))
        out["unchanged"].append(all(torch.equal(before[k], after[k]) for k in before))
    return out


def _resume(layout: dict[str, Any], directory: str) -> bool:
    """Same-layout resume: 2 steps, save, 1 step; a new engine loading the save and taking the 3rd step
    ends with bit-identical parameters."""
    parallel = ParallelConfig(**layout)
    ctx = init(parallel, init_method=init_method())
    dp, rank = ctx.size("dp"), ctx.coord("dp")

    def step(engine: Engine, k: int) -> None:
        x, y = batch(k)
        engine.train_step(list(zip(x.chunk(dp)[rank].chunk(2), y.chunk(dp)[rank].chunk(2))))

    def build() -> Engine:
        return Engine(lambda: build_model(MODEL, seed=0).to(DTYPE), adamw, ctx, parallel, group_fn=no_decay_for_vectors,
                      grad_clip=MAX_NORM)

    engine = build()
    step(engine, 0)
    step(engine, 1)
    engine.save(directory)
    step(engine, 2)
    resumed = build()
    resumed.load(directory)
    step(resumed, 2)
    a, b = engine.full_state_dict(), resumed.full_state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _suite(layouts: list[Layout], directory: str | None) -> dict[str, Any]:
    """Every layout's run; with a (shared) `directory` also the fp16 overflow and the resume checks."""
    runs = {name: _train(name, layout, accumulation) for name, layout, accumulation in layouts}
    if directory is None:
        return runs
    resumes = {name: _resume(layout, f"{directory}/{name}") for name, layout, _ in FAST if "zero" in name}
    return {**runs, "overflow": _overflow(), "resumes": resumes}


def reference() -> tuple[State, list[float], list[float], float]:
    """The single-process float64 run: parameters, losses, gradient norms (before clipping), validation loss."""
    model = build_model(MODEL, seed=0).to(DTYPE)
    groups = [{"params": [p for p in model.parameters() if p.ndim >= 2]},
              {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    opt = adamw(groups)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step)
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        x, y = batch(STEPS)
        val = model(x, y).item()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms, val


@pytest.fixture(scope="module")
def fast_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results of the one spawn running FAST, the overflow and the resumes (shared by the tests)."""
    return run_distributed(_suite, 4, FAST, str(tmp_path_factory.mktemp("checkpoints")), timeout=300)


def test_composed_layouts_train_like_one_process(fast_results: list[dict[str, Any]]) -> None:
    _check(FAST, fast_results)


@pytest.mark.slow
def test_more_composed_layouts_train_like_one_process() -> None:
    _check(SLOW, run_distributed(_suite, 4, SLOW, None, timeout=600))


def _check(layouts: list[Layout], results: list[dict[str, Any]]) -> None:
    ref_state, ref_losses, ref_norms, ref_val = reference()
    worst: dict[str, float] = {}  # parameters' max relative error (float64), the loss curve's and norms' (bf16/fp16)
    for name, layout, accumulation in layouts:
        low = any(p in name for p in LOW_PRECISION)
        tolerance = BF16_LOSS_TOLERANCE if low else 1e-5
        merged: State = {}
        for rank_result in results:
            run = rank_result[name]
            assert run["losses"] == pytest.approx(ref_losses, rel=tolerance), name
            # the global gradient norm (each parameter once; fp16: unscaled) equals the single process's
            assert run["norms"] == pytest.approx(ref_norms, rel=tolerance), name
            assert run["val"] == pytest.approx(ref_val, rel=tolerance), name
            assert run["tokens"] == GLOBAL_BATCH * SEQ, name
            if "zero3" in name or "zero2" in name:  # every unit (ZeRO-3: a block or the root) or bucket (ZeRO-2)
                # is reduce-scattered once per micro-batch (over a dp × cp group of 1 nothing is called)
                expected = run["units"] * accumulation if layout["dp"] * layout.get("cp", 1) > 1 else 0
                assert run["units"] >= 1 and run["reduce_scatters"] == expected, name
            if "zero3" in name:
                assert run["units"] >= 2, name  # the stage's blocks are units of their own
            merged.update(run["state"])
        assert merged.keys() == ref_state.keys(), name
        if low:
            run = results[0][name]
            assert run["losses"] != ref_losses and run["norms"] != ref_norms, name  # really in bf16/fp16
            worst[name] = max(abs(a - b) / b for a, b in zip(run["losses"] + run["norms"], ref_losses + ref_norms))
        else:
            worst[name] = assert_params_close(merged, ref_state, 1e-5, name)
    print("max relative error:", {k: f"{v:.1e}" for k, v in worst.items()})


def test_fp16_pipeline_skips_an_overflow_on_every_rank(fast_results: list[dict[str, Any]]) -> None:
    """The overflow is on stage 0's gradients only; stage 1's are finite, yet every rank skips the
    step, keeps its weights, and halves the scale (2 good steps had doubled it)."""
    for rank, result in enumerate(fast_results):
        r = result["overflow"]
        expected = [step == OVERFLOW_STEP for step in range(4)]
        assert r["skipped"] == expected, (rank, r)
        assert r["unchanged"] == expected, (rank, r)
        assert r["finite_norm"] == [not e for e in expected], (rank, r)  # the norm reads unscaled gradients
        assert r["scale"] == [2.0**10, 2.0**10, 2.0**11, 2.0**10], (rank, r)


def test_sharded_compositions_resume_bit_identically(fast_results: list[dict[str, Any]]) -> None:
    """ZeRO-1 × interleaved pp, ZeRO-3 × pp, ZeRO-2 × tp: a same-layout resume continues exactly."""
    for result in fast_results:
        assert result["resumes"] == {name: True for name, _, _ in FAST if "zero" in name}


def _hf_pipeline_context() -> dict[str, dict[str, torch.Tensor]]:
    """Tiny HF Llama and GPT-2 (tied head, learned positions) under pp=2 × cp=2, 1F1B, 2 micro-batches."""
    from tests.helpers.hf import STEPS as HF_STEPS, adamw as hf_adamw, batch as hf_batch, make_model

    parallel = ParallelConfig(pp=2, cp=2, pp_schedule="1f1b")
    ctx = init(parallel, init_method=init_method())
    out = {}
    for family in ("llama", "gpt2"):
        engine = Engine(lambda: make_model(family), hf_adamw, ctx, parallel)
        for step in range(HF_STEPS):
            x, y = hf_batch(step)
            engine.train_step(list(zip(x.chunk(2), y.chunk(2))))
        out[family] = engine.full_state_dict()
    return out


@pytest.mark.slow
def test_hf_pipeline_with_context_parallel_trains_like_one_process() -> None:
    """Hugging Face stages take each cp shard's global positions (RoPE; GPT-2's position embedding)."""
    pytest.importorskip("transformers")
    from tests.helpers.hf import TOL, make_model, reference as hf_reference

    results = run_distributed(_hf_pipeline_context, 4, timeout=600)
    for family in ("llama", "gpt2"):
        got: State = {}
        for result in results:
            got.update(result[family])
        names = [name for name, _ in make_model(family).named_parameters()]  # a tied head's copy dropped
        worst = assert_params_close({n: got[n] for n in names}, hf_reference(family, pieces=2), TOL, f"{family} pp2 × cp2")
        print(f"{family} pp2 × cp2: max relative error {worst:.1e}")
