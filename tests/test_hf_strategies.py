"""Hugging Face models under ndtrain's strategies: parity with single-process training of the same model.

Tiny HF Llama, Qwen2 (tied head) and GPT-2 (tied head), configs built here, seeded init, no
downloads, behind the `CausalLM` adapter, train 5 steps on 2 processes under dp=2, ZeRO-1/2/3
(units found from the model), recompute full/selective and tp=2 with and without sequence
parallelism (Llama, Qwen2; also dp=2 × tp=2 with SP and ZeRO-1 on 4 processes), and must end at
the parameters of single-process AdamW on the whole global batch (relative error ≤ 1e-5). One
spawn per (layout, fast or slow set) trains all of its cases; each (family, strategy) is then its
own test case. Llama's and GPT-2's main strategies are the fast set; Qwen2, the combinations and
the 4-process layout are marked slow.

The runs are float64, as tests/test_engine_zero.py's, so that the bound measures the strategies
and not the CPU kernels' fp32 summation order amplified by AdamW. (HF's RMSNorm and RoPE still
compute in fp32 inside a float64 model; measured errors stay ≤ 1e-11, README's table.)
Also here, single-process: layer lists found from the model, recompute on HF blocks called with
keyword arguments, `Engine(loss_fn=...)`, tensor-parallel refusals and a user plan. (GPT-2 and the
other families under tp: tests/test_hf_declared_tp.py.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ndtrain.config import ParallelConfig  # noqa: E402
from ndtrain.engine import Engine  # noqa: E402
from ndtrain.errors import UserError  # noqa: E402
from ndtrain.dist.mesh import ParallelContext, init  # noqa: E402
from ndtrain.models.causal_lm import CausalLM  # noqa: E402
from tests.helpers.hf import DTYPE, STEPS, TOL, VOCAB, adamw, batch, StrategyMatrix, make_model, reference  # noqa: E402
from tests.helpers.models import fake_tp_ctx  # noqa: E402
from tests.helpers.parity import assert_params_close  # noqa: E402
from tests.helpers.runner import Spawns, case_result, init_method, run_each  # noqa: E402

STRATEGIES = {  # strategy → (layout, parallel config changes)
    "dp": ("dp", {}), "zero1": ("dp", {"zero": 1}), "zero2": ("dp", {"zero": 2}), "zero3": ("dp", {"zero": 3}),
    "recompute_full": ("dp", {"recompute": "full"}), "recompute_selective": ("dp", {"recompute": "selective"}),
    "zero3_recompute_full": ("dp", {"zero": 3, "recompute": "full"}),
    "tp": ("tp", {}), "tp_sp": ("tp", {"sequence_parallel": True}),
    "tp_sp_recompute_full": ("tp", {"sequence_parallel": True, "recompute": "full"}),
    "tp_given_plan": ("tp", {}),  # Engine(tp_plan=MLP_PLAN): a user's plan instead of the family's
    "dp2_tp_sp_zero1": ("dp_tp", {"sequence_parallel": True, "zero": 1}),
}
MLP_PLAN = {"hf.model.layers.*.mlp.gate_proj": "colwise", "hf.model.layers.*.mlp.up_proj": "colwise",
            "hf.model.layers.*.mlp.down_proj": "rowwise", "hf.model.embed_tokens": "vocab", "hf.lm_head": "vocab"}
LAYOUTS = {"dp": ({}, 2), "tp": ({"tp": 2}, 2), "dp_tp": ({"tp": 2}, 4)}  # (axes, processes)
FAST = {"llama": ("dp", "zero1", "zero2", "zero3", "recompute_full", "tp", "tp_sp", "tp_given_plan"),
        "gpt2": ("dp", "zero1", "zero2", "zero3", "recompute_full")}
SLOW = {"llama": ("recompute_selective", "zero3_recompute_full", "tp_sp_recompute_full", "dp2_tp_sp_zero1"),
        "gpt2": ("recompute_selective", "zero3_recompute_full"),
        "qwen2": tuple(s for s in STRATEGIES if s != "tp_given_plan")}
MATRIX = StrategyMatrix(STRATEGIES, FAST, SLOW, {k: v[1] for k, v in LAYOUTS.items()})


def params(named: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's distinct parameters by name (a tied head's duplicate key dropped)."""
    return {name: named[name] for name, _ in model.named_parameters()}


# ------------------------------------------------------------------------------------ workers
def _train(ctx: ParallelContext, base: ParallelConfig, family: str, changes: dict[str, Any],
           plan: dict[str, str] | None = None) -> dict[str, Any]:
    engine = Engine(lambda: make_model(family), adamw, ctx, dataclasses.replace(base, **changes), tp_plan=plan)
    dp, rank = ctx.size("dp"), ctx.coord("dp")
    before = ctx.comm.stats.snapshot()
    for step in range(STEPS):
        x, y = batch(step)
        engine.train_step([(x.chunk(dp)[rank], y.chunk(dp)[rank])])
    ops = {op for op, v in ctx.comm.stats.snapshot().items() if v != before.get(op)}
    return {"params": engine.full_state_dict(), "ops": ops}


def _case(ctx: ParallelContext, base: ParallelConfig, family: str, strategy: str) -> dict[str, Any]:
    return _train(ctx, base, family, STRATEGIES[strategy][1], MLP_PLAN if strategy == "tp_given_plan" else None)


def _suite(layout: str, cases: list[tuple[str, str]]) -> dict[Any, Any]:
    base = ParallelConfig(**LAYOUTS[layout][0])
    ctx = init(base, init_method=init_method())
    return run_each(lambda case: _case(ctx, base, *case), cases)


@pytest.fixture(scope="module")
def spawns() -> Spawns:
    """One spawn per (layout, fast or slow set), at its first case, shared by its cases."""
    return Spawns(_suite, timeout=300)


@pytest.mark.parametrize(("family", "strategy", "slow"), MATRIX.params())
def test_matches_single_process(family: str, strategy: str, slow: bool, one_thread: None, spawns: Spawns) -> None:
    layout = STRATEGIES[strategy][0]
    run = MATRIX.runs(spawns, layout, slow)
    ref = reference(family, pieces=1 if layout == "tp" else 2)
    for rank, out in enumerate(case_result(run, (family, strategy))):
        got = params(out["params"], make_model(family))
        assert {t.dtype for t in got.values()} == {DTYPE}
        assert_params_close(got, ref, TOL, f"{family} {strategy} rank {rank}")
        ops = out["ops"]
        if layout != "dp":  # sequence parallelism replaces the tp all-reduces by all-gather + reduce-scatter
            assert ("reduce_scatter/tp" in ops) == ("sp" in strategy), ops
            assert "all_reduce/tp" in ops or "sp" in strategy, ops
        if "zero3" in strategy:  # units gathered through the shared-memory ring (one host, the default)
            assert "all_gather_shm/dp_cp" in ops and "reduce_scatter_shm/dp_cp" in ops, ops


# ------------------------------------------------------------------------------------ single process
def test_layer_lists_are_found_from_the_model() -> None:
    from ndtrain.models.hf_families import decoder_layers
    from ndtrain.models.llama import build_model
    from ndtrain.config import config_from_dict
    from ndtrain.parallel.data.zero3_wrap import wrap_patterns

    llama, gpt2 = make_model("llama"), make_model("gpt2")
    assert decoder_layers(llama)[0] == "hf.model.layers" and decoder_layers(gpt2)[0] == "hf.transformer.h"
    assert decoder_layers(gpt2.hf)[0] == "transformer.h"
    assert wrap_patterns(llama, "auto") == ["hf.model.layers.*"]
    assert wrap_patterns(llama, "a.*, b") == ["a.*", "b"]
    builtin = build_model(config_from_dict({"model": {"preset": "tiny"}}).model, seed=0)
    assert wrap_patterns(builtin, "auto") == ["layers.*"]

    class Custom(torch.nn.Module):  # the largest list of one block class wins; mixed lists never do
        def __init__(self) -> None:
            super().__init__()
            self.heads = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
            self.mixed = torch.nn.ModuleList([torch.nn.Linear(64, 64), torch.nn.ReLU()])
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])

    assert decoder_layers(Custom())[0] == "blocks"
    assert wrap_patterns(torch.nn.Linear(2, 2), "auto") == []


@pytest.mark.parametrize(("mode", "q_calls", "down_calls"), [("full", 2, 2), ("selective", 2, 1)])
def test_recompute_reruns_hf_blocks_called_with_keywords(mode: str, q_calls: int, down_calls: int) -> None:
    """full: each decoder layer runs again in backward; selective: its attention module only."""
    from ndtrain.parallel.model.recompute import apply_recompute

    model = apply_recompute(make_model("llama"), mode)
    calls = {"q": 0, "down": 0}
    for layer in model.hf.model.layers:
        layer.self_attn.q_proj.register_forward_hook(lambda *_: calls.__setitem__("q", calls["q"] + 1))
        layer.mlp.down_proj.register_forward_hook(lambda *_: calls.__setitem__("down", calls["down"] + 1))
    x, y = batch(0)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # rerun whole modules, not up to the last saved tensor
        loss = model(x, y)
        assert calls == {"q": 2, "down": 2}
        loss.backward()
    assert calls == {"q": 2 * q_calls, "down": 2 * down_calls}


def test_engine_loss_fn_applies_to_the_models_output() -> None:
    """Engine(loss_fn=...) calls model(tokens) and applies it: the same training as the model's own loss."""
    ctx = init(ParallelConfig())
    own = Engine(lambda: make_model("gpt2"), adamw, ctx, ParallelConfig())
    given = Engine(lambda: make_model("gpt2"), adamw, ctx, ParallelConfig(), loss_fn=CausalLM.loss_fn)
    for step in range(2):
        a, b = own.train_step([batch(step)]), given.train_step([batch(step)])
        assert a.loss == b.loss
    assert_params_close(given.full_state_dict(), own.full_state_dict(), 0.0, "loss_fn")
    evaluated, own_evaluated = given.evaluate([batch(9)]), own.evaluate([batch(9)])
    assert (evaluated.loss, evaluated.tokens) == (own_evaluated.loss, own_evaluated.tokens)
    assert evaluated.accuracy is None  # the caller's loss_fn: its output's meaning is the caller's


def test_tensor_parallel_refusals_are_one_line() -> None:
    from ndtrain.models.hf_parallel import spec_of
    from ndtrain.parallel.model.tp_plan import parallelize
    from ndtrain.parallel.model_spec import bind_spec

    bare = make_model("llama").hf
    bind_spec(bare, spec_of(bare))  # as Engine does: a bare transformers model gets its family's spec
    cases = [
        (bare, None, "needs the adapter"),
        (make_model("llama"), {"hf.model.layers.*.mlp.up_proj": "colwise"}, "must make 'hf.lm_head' vocab-parallel"),
    ]
    falcon = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4)
    cases.append((CausalLM(transformers.FalconForCausalLM(falcon)), None,  # its config declares no plans
                  "no built-in tp plan for Hugging Face model_type 'falcon': pass a plan, Engine"))
    for model, plan, message in cases:
        with pytest.raises(UserError, match=message) as error:
            parallelize(model, fake_tp_ctx(2), plan)
        assert "\n" not in str(error.value)


def test_a_plan_given_for_an_hf_model_splits_what_it_names() -> None:
    """A user plan (here: the MLP only) on an HF model: those weights split, attention left whole."""
    from ndtrain.parallel.model.tp_plan import parallelize

    model = make_model("llama")
    full = {k: v.clone() for k, v in model.state_dict().items()}
    plan = {"hf.model.layers.*.mlp.gate_proj": "colwise", "hf.model.layers.*.mlp.up_proj": "colwise",
            "hf.model.layers.*.mlp.down_proj": "rowwise", "hf.lm_head": "vocab"}
    parallelize(model, fake_tp_ctx(2), plan)
    layer = model.hf.model.layers[0]
    assert torch.equal(layer.mlp.up_proj.weight, full["hf.model.layers.0.mlp.up_proj.weight"][:64])
    assert torch.equal(layer.mlp.down_proj.weight, full["hf.model.layers.0.mlp.down_proj.weight"][:, :64])
    assert torch.equal(layer.self_attn.q_proj.weight, full["hf.model.layers.0.self_attn.q_proj.weight"])
