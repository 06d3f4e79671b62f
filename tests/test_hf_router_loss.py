"""The MoE router's load-balancing loss (models/hf_router_loss.py) in the training loss, under every layout.

Single process: the `CausalLM` adapter's training loss equals the model's own forward with labels
(cross-entropy + `router_aux_loss_coef` · aux) for Mixtral, Qwen2-MoE and Qwen3-MoE: the router term
and its gradient exactly (transformers accumulates aux in float32, and so does ndtrain), the whole
loss to float32 rounding (transformers computes its cross-entropy in float32 even for a float64
model; the adapter in float64). With output_router_logits false or a zero coefficient the loss is
cross-entropy alone, and so is the evaluation loss (eval mode) always.

Layouts: tiny float64 MoE models (tests/helpers/hf_zoo.py) with output_router_logits=true and
coefficient COEF train 5 steps and must end at the parameters of single-process training whose loss
per step is the mean of the layout's micro-batches, each with its own router term (relative error ≤ 1e-5;
leaving the term out, or computing it over half of a micro-batch's tokens, moves the parameters by
≥ 4e-2: `test_the_term_moves_the_reference`). dp2, ZeRO-3, recompute (routers run again in backward),
cp2 (one all-reduce of the counts per forward), pp2 (1f1b, zb: the counts ride on the activation),
tp2 with and without sequence parallelism, and on 4 processes cp2×pp2, tp2×pp2 with sequence
parallelism and dp2×pp2 with ZeRO-1; Qwen2-MoE with a dense last layer under pp2 and tp2×pp2 (its last
stage runs no router: the counts all come from the stage before). Each layout's evaluation loss must be
the reference's cross-entropy. One spawn per number of processes trains all of its cases, layout after
layout; in CI a representative part runs (Qwen3-MoE under cp2 and pp2: the all-reduce and the stats
riding on the activation), the rest is slow.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ndtrain.config import ParallelConfig  # noqa: E402
from ndtrain.dist.mesh import ParallelContext, init  # noqa: E402
from ndtrain.engine import Engine  # noqa: E402
from tests.helpers.hf import DTYPE, STEPS, TOL, adamw, batch  # noqa: E402
from tests.helpers.hf_zoo import zoo_model  # noqa: E402
from tests.helpers.parity import assert_params_close, max_relative_error  # noqa: E402
from tests.helpers.reference import decay_groups, train_reference  # noqa: E402
from tests.helpers.runner import Spawns, case_result, init_method, run_each  # noqa: E402

MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
COEF = 0.02  # Mixtral's published coefficient; transformers' default 0.001 moves the tiny models less
MICRO = 2  # pipeline micro-batches
CASES: dict[str, tuple[str, dict[str, Any]]] = {  # case → (layout, parallel config changes)
    "dp2": ("dp", {}), "dp2_zero3": ("dp", {"zero": 3}), "dp2_recompute": ("dp", {"recompute": "full"}),
    "cp2": ("cp", {}), "cp2_recompute": ("cp", {"recompute": "full"}), "cp2_zero3": ("cp", {"zero": 3}),
    "pp2_1f1b": ("pp", {"pp_schedule": "1f1b"}), "pp2_zb": ("pp", {"pp_schedule": "zb"}),
    "pp2_recompute": ("pp", {"pp_schedule": "1f1b", "recompute": "full"}),
    "tp2_sp": ("tp", {"sequence_parallel": True}), "tp2": ("tp", {}),
    "cp2_pp2": ("cp_pp", {"pp_schedule": "1f1b"}),
    "tp2_sp_pp2": ("tp_pp", {"sequence_parallel": True, "pp_schedule": "1f1b"}),
    "dp2_pp2_zero1": ("dp_pp", {"zero": 1, "pp_schedule": "1f1b"}),
}
LAYOUTS = {"dp": ({}, 2), "cp": ({"cp": 2}, 2), "pp": ({"pp": 2}, 2), "tp": ({"tp": 2}, 2),  # → (axes, processes)
           "cp_pp": ({"cp": 2, "pp": 2}, 4), "tp_pp": ({"tp": 2, "pp": 2}, 4), "dp_pp": ({"pp": 2}, 4)}
# Qwen2-MoE with a dense MLP in its last layer: the last pipeline stage runs no router of its own
VARIANTS = {"qwen2_moe_dense_last": ("qwen2_moe", {"mlp_only_layers": [1]})}
CELLS = [(f, c) for c in CASES for f in MOE] + [("qwen2_moe_dense_last", c) for c in ("pp2_1f1b", "tp2_sp_pp2")]
FAST = {("qwen3_moe", "pp2_1f1b")}  # CI: the pipeline, where the counts ride on the activation; the rest slow


def _model(family: str, **changes: Any) -> torch.nn.Module:
    family, variant = VARIANTS.get(family, (family, {}))
    return zoo_model(family, **{"output_router_logits": True, "router_aux_loss_coef": COEF, **variant, **changes})


def _pieces(case: str) -> int:
    """The micro-batches of one step over the whole world: the reference's loss is the mean of as many."""
    layout, _ = CASES[case]
    axes, processes = LAYOUTS[layout]
    dp = processes // (axes.get("tp", 1) * axes.get("pp", 1) * axes.get("cp", 1))
    return dp * (MICRO if "pp" in axes else 1)


@functools.cache
def _reference(family: str, pieces: int, coef: float = COEF) -> dict[str, torch.Tensor]:
    return _reference_run(family, pieces, coef)[0]


@functools.cache
def _reference_run(family: str, pieces: int, coef: float = COEF) -> tuple[dict[str, torch.Tensor], float]:
    """The reference's parameters and its evaluation loss (eval mode: cross-entropy) on batch STEPS."""
    model = _model(family, router_aux_loss_coef=coef, output_router_logits=coef > 0)
    params = train_reference(model, adamw(decay_groups(model)), map(batch, range(STEPS)), pieces=pieces).params
    model.eval()
    with torch.no_grad():
        return params, model(*batch(STEPS)).item()


# ------------------------------------------------------------------------------------ single process
@pytest.mark.parametrize("family", MOE)
def test_the_adapters_loss_is_the_models_own(family: str, one_thread: None) -> None:
    model = _model(family)
    x, y = batch(0)
    own = model.hf(input_ids=x, labels=y, shift_labels=y.contiguous(), use_cache=False)  # y is already shifted
    loss = model(x, y)
    # the model's own loss with the adapter's float64 cross-entropy of the model's own logits
    expected = model.loss_fn(own.logits, y) + COEF * own.aux_loss
    assert loss.dtype == DTYPE and COEF * own.aux_loss.item() > 1e-3
    assert abs(loss.item() - expected.item()) <= 1e-12 * expected.item()
    assert abs(loss.item() - own.loss.item()) <= 1e-6 * own.loss.item()  # transformers' fp32 cross-entropy
    params = dict(model.named_parameters())
    ours = torch.autograd.grad(loss, list(params.values()))
    theirs = torch.autograd.grad(expected, list(params.values()))
    assert_params_close(dict(zip(params, ours)), dict(zip(params, theirs)), 1e-12, "gradients")


@pytest.mark.parametrize("changes", [{"output_router_logits": False}, {"router_aux_loss_coef": 0.0}],
                         ids=["no_router_logits", "zero_coefficient"])
def test_without_the_term_the_loss_is_cross_entropy(changes: dict[str, Any], one_thread: None) -> None:
    model = _model("mixtral", **changes)
    x, y = batch(1)
    assert model.router_loss is None
    logits = model.hf(input_ids=x, use_cache=False).logits
    assert model(x, y).item() == model.loss_fn(logits, y).item()


def test_evaluation_reports_cross_entropy(one_thread: None) -> None:
    """In eval mode (Engine.evaluate) the loss is the cross-entropy, nats per token, without the router term."""
    model = _model("qwen3_moe")
    x, y = batch(1)
    training = model(x, y).item()
    model.eval()
    logits = model.hf(input_ids=x, use_cache=False, output_router_logits=False).logits
    assert model(x, y).item() == model.loss_fn(logits, y).item() < training - 1e-3


def test_routers_run_again_in_backward_are_not_counted(one_thread: None) -> None:
    """recompute=full runs each layer (and its router) again in backward: the next step's term is unchanged."""
    from ndtrain.parallel.model.recompute import apply_recompute

    plain, recomputed = _model("qwen3_moe"), apply_recompute(_model("qwen3_moe"), "full")
    for step in range(2):
        x, y = batch(step)
        a, b = plain(x, y), recomputed(x, y)
        assert a.item() == b.item(), step
        a.backward()
        b.backward()
    assert_params_close({n: p.grad for n, p in recomputed.named_parameters()},
                        {n: p.grad for n, p in plain.named_parameters()}, 1e-12, "gradients")


@pytest.mark.parametrize("family", [pytest.param(f, marks=[] if f == "qwen3_moe" else [pytest.mark.slow]) for f in MOE])
def test_the_term_moves_the_reference(family: str, one_thread: None) -> None:
    """The parity below can fail: without the term, or with it over half the tokens, the parameters
    differ by far more than TOL."""
    with_term = _reference(family, 1)
    assert max_relative_error(_reference(family, 1, coef=0.0), with_term) > 4e-2
    assert max_relative_error(_reference(family, 2), with_term) > 4e-2


# ------------------------------------------------------------------------------------ workers
def _train(ctx: ParallelContext, base: ParallelConfig, family: str, case: str) -> dict[str, Any]:
    parallel = dataclasses.replace(base, **CASES[case][1])
    engine = Engine(lambda: _model(family), adamw, ctx, parallel)
    dp, rank = ctx.size("dp"), ctx.coord("dp")
    micro = MICRO if parallel.pp > 1 else 1
    before = ctx.comm.stats.snapshot()
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x.chunk(dp)[rank], y.chunk(dp)[rank]
        losses.append(engine.train_step(list(zip(x.chunk(micro), y.chunk(micro)))).loss)
    ops = {op for op, v in ctx.comm.stats.snapshot().items() if v != before.get(op)}
    evaluation = engine.evaluate([tuple(t.chunk(dp)[rank] for t in batch(STEPS))]).loss
    return {"params": engine.full_state_dict(), "losses": losses, "ops": ops, "eval": evaluation}


def _suite(cases: list[tuple[str, str]]) -> dict[Any, Any]:
    """Every case in turn, each layout's groups built once on the one world (as test_engine_layouts does)."""
    contexts: dict[str, tuple[ParallelContext, ParallelConfig]] = {}

    def run(family: str, case: str) -> dict[str, Any]:
        layout = CASES[case][0]
        if layout not in contexts:
            base = ParallelConfig(**LAYOUTS[layout][0])
            contexts[layout] = (init(base, init_method=init_method()), base)
        return _train(*contexts[layout], family, case)

    return run_each(lambda case: run(*case), cases)


@pytest.fixture(scope="module")
def spawns() -> Spawns:
    return Spawns(_suite, timeout=600)


def _params() -> list[Any]:
    return [pytest.param(family, case, id=f"{family}-{case}",
                         marks=[] if (family, case) in FAST else [pytest.mark.slow])
            for family, case in CELLS]


@pytest.mark.parametrize(("family", "case"), _params())
def test_layout_matches_one_process(family: str, case: str, one_thread: None, spawns: Spawns) -> None:
    layout = CASES[case][0]
    slow, processes = (family, case) not in FAST, LAYOUTS[layout][1]
    cases = [(f, c) for f, c in CELLS if LAYOUTS[CASES[c][0]][1] == processes and ((f, c) not in FAST) == slow]
    run = case_result(spawns.get((processes, slow), processes, cases), (family, case))
    got: dict[str, torch.Tensor] = {}
    for out in run:  # pipeline ranks each hold their stages' parameters (tp gathered)
        got.update(out["params"])
    names = [name for name, _ in _model(family).named_parameters()]
    got = {name: got[name] for name in names}
    assert {t.dtype for t in got.values()} == {DTYPE}
    params, evaluation = _reference_run(family, _pieces(case))
    error = assert_params_close(got, params, TOL, f"{family} {case}")
    print(f"{family} {case}: max relative error {error:.3e}")
    assert all(out["losses"] == run[0]["losses"] for out in run)
    assert abs(run[0]["eval"] - evaluation) <= TOL * evaluation, (run[0]["eval"], evaluation)  # cross-entropy alone
    if "cp" in layout:  # the counts' all-reduce (ring attention only sends and receives over cp), last stage
        assert "all_reduce/cp" in run[-1]["ops"], run[-1]["ops"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_stats_ride_on_the_activation_bit_for_bit(dtype: torch.dtype) -> None:
    """Pipeline stages: float32 stats packed into an activation of any dtype and unpacked unchanged, both
    ways (values whose bytes read as NaN, inf or -0 in the activation's dtype included)."""
    from ndtrain.models.hf_router_loss import _Pack, _Unpack

    bits = torch.tensor([0x7FC0_0001, 0xFF80_8000, 0x8000_7F80, 0x3F80_0000, 0x0000_FFFF, 0x7F80_0000],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    hidden = torch.randn(2, 3, 4, dtype=torch.float64).to(dtype).requires_grad_()
    stats = bits.clone().requires_grad_()
    packed = _Pack.apply(hidden, stats)
    assert packed.dtype == dtype and packed.ndim == 1
    received = packed.detach().requires_grad_()  # what the next stage gets
    out_hidden, out_stats = _Unpack.apply(received, bits.numel(), 2, 4)
    assert torch.equal(out_hidden, hidden) and torch.equal(out_stats.view(torch.int32), bits.view(torch.int32))
    grad_hidden, grad_stats = torch.randn(2, 3, 4, dtype=torch.float64).to(dtype), bits.flip(0)  # awkward bytes back
    torch.autograd.backward([out_hidden, out_stats], [grad_hidden, grad_stats], inputs=[received])
    packed.backward(received.grad)  # what the previous stage does with the gradient it receives
    assert torch.equal(stats.grad.view(torch.int32), grad_stats.view(torch.int32))
    assert torch.equal(hidden.grad, grad_hidden)


def test_a_model_whose_routers_cannot_be_found_is_refused_in_one_line() -> None:
    from ndtrain.errors import UserError
    from ndtrain.models.hf_router_loss import RouterLoss

    class Opaque(torch.nn.Module):  # adds a router loss in its forward, records no router class
        config = transformers.PretrainedConfig(output_router_logits=True)
        config.model_type = "opaque_moe"
        router_aux_loss_coef = 0.01

    with pytest.raises(UserError, match="opaque_moe: output_router_logits=true") as error:
        RouterLoss.of(Opaque())
    assert "\n" not in str(error.value)
