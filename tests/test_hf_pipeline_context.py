"""Hugging Face models under pipeline (pp=2) and context parallel (cp=2): parity with one process.

Tiny HF Llama, GPT-2 and Qwen2 (the builders of tests/helpers/hf.py; seeded, float64,
no downloads) behind the `CausalLM` adapter train 5 steps and must end at the parameters of
single-process AdamW on the whole global batch (relative error ≤ 1e-5; see test_hf_strategies
for why float64). Pipeline: stages cut from the model's decoder-layer list (hf_stages.py), two
micro-batches, schedules 1f1b and zb (and gpipe, interleaved with 2 virtual stages on a 4-layer
model, slow), Qwen2's tied embedding/head split across the two ranks. Context parallel: every
attention through ring attention (hf_context.py) with the load-balanced chunks' global positions.
One spawn per layout trains all of its cases.
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
from tests.helpers.hf import DTYPE, STEPS, TOL, adamw, batch, StrategyMatrix, make_model, reference  # noqa: E402
from tests.helpers.parity import assert_params_close  # noqa: E402
from tests.helpers.runner import Spawns, case_result, init_method, run_each  # noqa: E402

MICRO = 2  # pipeline micro-batches

STRATEGIES = {  # strategy → (layout, parallel config changes, decoder layers)
    "pp_1f1b": ("pp", {"pp_schedule": "1f1b"}, 2), "pp_zb": ("pp", {"pp_schedule": "zb"}, 2),
    "pp_gpipe": ("pp", {"pp_schedule": "gpipe"}, 2),
    "pp_interleaved": ("pp", {"pp_schedule": "interleaved", "pp_virtual": 2}, 4),
    "pp_1f1b_recompute_full": ("pp", {"pp_schedule": "1f1b", "recompute": "full"}, 2),
    "cp": ("cp", {}, 2), "cp_recompute_selective": ("cp", {"recompute": "selective"}, 2),
    "cp_zero3": ("cp", {"zero": 3}, 2),
    # the bare *ForCausalLM with Engine(loss_fn=...) on its output, instead of the adapter
    "pp_1f1b_bare_loss_fn": ("pp", {"pp_schedule": "1f1b"}, 2), "cp_bare_loss_fn": ("cp", {}, 2),
    # pipeline × tensor parallel (4 processes): stages of a model already split over tp
    "tp_pp_1f1b": ("tp_pp", {"pp_schedule": "1f1b"}, 2), "tp_sp_pp_1f1b": ("tp_pp", {"sequence_parallel": True}, 2),
}
LAYOUTS = {"pp": {"pp": 2}, "cp": {"cp": 2}, "tp_pp": {"tp": 2, "pp": 2}}
PROCESSES = {"pp": 2, "cp": 2, "tp_pp": 4}
FAST = {"llama": ("pp_1f1b", "pp_zb", "cp", "pp_1f1b_bare_loss_fn", "cp_bare_loss_fn"), "gpt2": ("pp_1f1b", "cp")}
SLOW = {"llama": ("pp_gpipe", "pp_interleaved", "pp_1f1b_recompute_full", "cp_recompute_selective", "cp_zero3",
                  "tp_pp_1f1b", "tp_sp_pp_1f1b"),
        "gpt2": ("pp_zb", "pp_interleaved", "cp_zero3"),
        "qwen2": ("pp_1f1b", "pp_zb", "pp_interleaved", "cp")}
MATRIX = StrategyMatrix(STRATEGIES, FAST, SLOW, PROCESSES)


# ------------------------------------------------------------------------------------ workers
def _train(ctx: ParallelContext, base: ParallelConfig, family: str, strategy: str) -> dict[str, Any]:
    layout, changes, layers = STRATEGIES[strategy]
    parallel = dataclasses.replace(base, **changes)
    if strategy.endswith("bare_loss_fn"):
        engine = Engine(lambda: make_model(family, layers).hf, adamw, ctx, parallel, loss_fn=_bare_loss)
    else:
        engine = Engine(lambda: make_model(family, layers), adamw, ctx, parallel)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        pieces = MICRO if "pp" in layout else 1
        losses.append(engine.train_step(list(zip(x.chunk(pieces), y.chunk(pieces)))).loss)
    params = engine.full_state_dict()
    if strategy.endswith("bare_loss_fn"):  # the adapter's names, to compare with the reference
        params = {f"hf.{k}": v for k, v in params.items()}
    return {"params": params, "losses": losses}


def _bare_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """What a user writes for a bare HF model: cross-entropy of its output's logits (the adapter's loss)."""
    return CausalLM.loss_fn(output.logits, targets)


def _refusals(ctx: ParallelContext, base: ParallelConfig) -> dict[str, str]:
    """The one-line errors of models a pipeline cannot cut."""
    falcon = transformers.FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    attempts = {  # Falcon's config declares no pipeline plan
        "unknown_family": (lambda: CausalLM(transformers.AutoModelForCausalLM.from_config(falcon)), base),
        "bare_without_loss_fn": (lambda: make_model("llama", 2).hf, base),
        "measured": (lambda: make_model("llama", 2), dataclasses.replace(base, pp_balance="measured")),
    }
    out = {}
    for name, (model_fn, parallel) in attempts.items():
        try:
            Engine(model_fn, adamw, ctx, parallel)
        except UserError as e:
            out[name] = str(e)
    return out


def _suite(layout: str, cases: list[tuple[str, str]]) -> dict[Any, Any]:
    base = ParallelConfig(**LAYOUTS[layout])
    ctx = init(base, init_method=init_method())
    out = run_each(lambda case: _train(ctx, base, *case), cases)
    if layout == "pp":
        out["refusals"] = _refusals(ctx, base)
    if layout == "cp":
        sliding = transformers.Qwen2Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=0,
        )
        engine = Engine(lambda: CausalLM(transformers.AutoModelForCausalLM.from_config(sliding)), adamw, ctx, base)
        try:  # the window is narrower than the batch's 32 tokens: the first forward's attention refuses it
            engine.train_step([batch(0)])
        except UserError as e:
            out["sliding_refusal"] = str(e)
    return out


@pytest.fixture(scope="module")
def spawns() -> Spawns:
    """One spawn per (layout, fast or slow set), at its first case, shared by its cases."""
    return Spawns(_suite, timeout=300)


@pytest.mark.parametrize(("family", "strategy", "slow"), MATRIX.params())
def test_matches_single_process(family: str, strategy: str, slow: bool, one_thread: None, spawns: Spawns) -> None:
    layout, _, layers = STRATEGIES[strategy]
    run = case_result(MATRIX.runs(spawns, layout, slow), (family, strategy))
    ref = reference(family, pieces=MICRO if "pp" in layout else 1, layers=layers)
    got: dict[str, torch.Tensor] = {}
    for out in run:  # pipeline: each rank holds its stages' parameters (tp gathered); cp: the whole model
        got.update(out["params"])
    names = [name for name, _ in make_model(family, layers).named_parameters()]  # a tied head's copy dropped
    if "pp" in layout:
        owned = [set(out["params"]) for out in run[:: len(run) // 2]]  # pp ranks 0, 1 (tp rank 0)
        assert not (owned[0] & owned[1]), "a pipeline parameter is on both ranks"
        assert set(names) <= owned[0] | owned[1]
    tied = {"hf.lm_head.weight": "hf.model.embed_tokens.weight"} if family == "qwen2" else {}
    copies = {head: got[head] for head in tied}  # pipeline: the last stage's copy of the tied embedding
    got = {name: got[name] for name in names}
    assert {t.dtype for t in got.values()} == {DTYPE}
    assert_params_close(got, ref, TOL, f"{family} {strategy}")
    assert_params_close(copies, {head: ref[emb] for head, emb in tied.items()}, TOL, f"{family} {strategy} tied head")
    assert all(out["losses"] == run[0]["losses"] for out in run)


def test_context_parallel_refuses_sliding_window_in_one_line(spawns: Spawns) -> None:
    message = MATRIX.runs(spawns, "cp", False)[0]["sliding_refusal"]
    assert "\n" not in message and "sliding window of 8 tokens" in message, message


@pytest.mark.parametrize(("case", "words"), [
    ("unknown_family", "not supported for Hugging Face model_type 'falcon': its config declares no pipeline plan"),
    ("bare_without_loss_fn", "needs loss_fn"),
    ("measured", "'measured' is not supported for Hugging Face models"),
])
def test_pipeline_refuses_in_one_line(case: str, words: str, spawns: Spawns) -> None:
    message = MATRIX.runs(spawns, "pp", False)[0]["refusals"][case]
    assert "\n" not in message and words in message, message
