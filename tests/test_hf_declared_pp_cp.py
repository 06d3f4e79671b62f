"""Pipeline and context parallel of the 14 HF families from their declared plans: float64 parity with one process.

Models (tests/helpers/hf_zoo.py, seeded, float64, no downloads) with 2 decoder layers. Under pipeline
layouts the family's sliding window, where it has one, is 8 tokens (narrower than the 32-token
sequences) and, where it has layer types, layer 0 is full and layer 1 sliding: the second stage holds
layer 1, which a stage choosing its mask by its local index (0) would make full, and Mistral, Mixtral
and Phi-3 pick the sliding mask from `config.sliding_window` alone. Gemma3's rotary
tables per layer type, Gemma2's final-logit soft-capping and eager attention, GPT-NeoX's embedding
dropout, MoE routers: all run by the family's own forward inside each stage (models/hf_stages.py).
Under cp the window is 32 tokens, as wide as the sequence: full causal attention, accepted.

Layouts: pp2 (1f1b, two micro-batches), cp2 (ring attention through transformers' attention interface),
dp2 × pp2 with ZeRO-1 and tp2 (sequence parallel) × pp2 (4 processes each). Each cell trains 5 steps
of AdamW and must end at the parameters of single-process training on the whole global batch whose
loss is the mean of the same micro-batches (relative error ≤ 1e-5, tests/helpers/parity.py), with
every rank reporting the same losses. `REFUSED` cells must instead be refused in one line naming why.
Gemma's norms are computed in float64 (tests/helpers/hf_float64.py: transformers computes them in
float32). One spawn per layout (and CI or slow set) trains its families in turn; CI runs pp2 for Gemma2
(soft-capped logits on the last stage, eager attention, a sliding layer on the second stage) and cp2 for
GPT-NeoX (fused per-head q/k/v), to keep make test within 20 minutes; the rest (Gemma3's rotary tables per
layer type and its window as wide as the sequence among them) is `slow` (tests/test_hf_family_matrix.py covers the
default-window models).

Before workers (no spawn): the launcher's checks (models/hf.py `check_family_supports` on the
meta-device model) refuse cp for soft-capped attention, attention sinks, windows narrower than the
sequence, attention dropout and masks of the family's own, and pp for parameters outside the pipeline
plan, each in one line starting with the axis.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ndtrain.config import ParallelConfig  # noqa: E402
from ndtrain.dist.mesh import ParallelContext, init  # noqa: E402
from ndtrain.engine import Engine  # noqa: E402
from ndtrain.errors import UserError  # noqa: E402
from ndtrain.models.hf import check_family_supports  # noqa: E402
from ndtrain.models.hf_context import check_attention_call  # noqa: E402
from tests.helpers.hf import DTYPE, STEPS, TOL, adamw, batch  # noqa: E402
from tests.helpers.hf_float64 import float64_gemma_norms  # noqa: E402
from tests.helpers.hf_zoo import FAMILIES, zoo_config, zoo_model  # noqa: E402
from tests.helpers.parity import assert_params_close  # noqa: E402
from tests.helpers.reference import decay_groups, train_reference  # noqa: E402
from tests.helpers.runner import Spawns, case_result, init_method, run_each  # noqa: E402

LAYERS = 2
PATTERN = ["full_attention", "sliding_attention"]  # the layer types by global index
MICRO = 2  # pipeline micro-batches per data-parallel rank
LAYOUTS: dict[str, tuple[dict[str, Any], int, int]] = {  # layout → (parallel config, processes, window)
    "pp2": ({"pp": 2, "pp_schedule": "1f1b"}, 2, 8),
    "cp2": ({"cp": 2}, 2, 32),
    "dp2_pp2_zero1": ({"pp": 2, "zero": 1, "pp_schedule": "1f1b"}, 4, 8),
    "tp2_sp_pp2": ({"tp": 2, "sequence_parallel": True, "pp": 2, "pp_schedule": "1f1b"}, 4, 8),
}
FAST = {"pp2": ("gemma2",), "cp2": ("gpt_neox",)}  # CI; the other families and layouts are slow
REFUSED = {("gemma2", "cp2"): "attention logit soft-capping (softcap)"}


def window_changes(family: str, window: int) -> dict[str, Any]:
    """Config changes giving `family` a sliding window of `window` tokens on the layers `PATTERN` names (on
    every layer where the family has no layer types); none for a family without sliding windows."""
    config = zoo_config(family, LAYERS)
    if not hasattr(config, "sliding_window"):
        return {}
    changes: dict[str, Any] = {"sliding_window": window}
    if hasattr(config, "use_sliding_window"):
        changes["use_sliding_window"] = True
    if getattr(config, "layer_types", None) is not None:
        changes["layer_types"] = PATTERN
    return changes


def _model(family: str, window: int) -> torch.nn.Module:
    """The family's model, Gemma's norms in float64 (tests/helpers/hf_float64.py says why)."""
    return float64_gemma_norms(zoo_model(family, LAYERS, **window_changes(family, window)))


def _cells() -> list[Any]:
    return [pytest.param(family, layout, id=f"{family}-{layout}",
                         marks=[] if family in FAST.get(layout, ()) else [pytest.mark.slow])
            for layout in LAYOUTS for family in FAMILIES]


def _pieces(layout: str) -> int:
    """Micro-batches per step over the whole world: the reference's loss is the mean of as many equal chunks."""
    changes, processes, _ = LAYOUTS[layout]
    dp = processes // (changes.get("tp", 1) * changes.get("pp", 1) * changes.get("cp", 1))
    return dp * (MICRO if changes.get("pp", 1) > 1 else 1)


# ------------------------------------------------------------------------------------ workers
def _train(ctx: ParallelContext, parallel: ParallelConfig, family: str, window: int) -> dict[str, Any]:
    """5 steps, or the refusal: the Engine's, or under cp the attention's at the first forward (every rank
    of the cp group refuses the same call, so none waits in the ring)."""
    dp, rank = ctx.size("dp"), ctx.coord("dp")
    micro = MICRO if parallel.pp > 1 else 1
    losses = []
    try:
        engine = Engine(lambda: _model(family, window), adamw, ctx, parallel)
        for step in range(STEPS):
            x, y = batch(step)
            x, y = x.chunk(dp)[rank], y.chunk(dp)[rank]
            losses.append(engine.train_step(list(zip(x.chunk(micro), y.chunk(micro)))).loss)
    except UserError as e:
        return {"refused": str(e)}
    return {"params": engine.full_state_dict(), "losses": losses}


def _suite(layout: str, families: list[str]) -> dict[Any, Any]:
    changes, _, window = LAYOUTS[layout]
    parallel = ParallelConfig(**changes)
    ctx = init(parallel, init_method=init_method())
    return run_each(lambda family: _train(ctx, parallel, family, window), families)


@pytest.fixture(scope="module")
def spawns() -> Spawns:
    return Spawns(_suite, timeout=900)


@functools.cache
def _reference(family: str, window: int, pieces: int) -> dict[str, torch.Tensor]:
    model = _model(family, window)
    return train_reference(model, adamw(decay_groups(model)), map(batch, range(STEPS)), pieces=pieces).params


# ------------------------------------------------------------------------------------ cells
@pytest.mark.parametrize(("family", "layout"), _cells())
def test_family_matches_one_process(family: str, layout: str, spawns: Spawns) -> None:
    fast = family in FAST.get(layout, ())
    families = [f for f in FAMILIES if (f in FAST.get(layout, ())) == fast]
    _, processes, window = LAYOUTS[layout]
    run = case_result(spawns.get((layout, fast), processes, layout, families), family)
    if (family, layout) in REFUSED:
        message = run[0].get("refused", "")
        assert "\n" not in message and REFUSED[family, layout] in message and message.startswith("--cp 2: "), run[0]
        return
    assert "refused" not in run[0], run[0]["refused"]
    got: dict[str, torch.Tensor] = {}
    for out in run:  # pipeline ranks each hold their stages' parameters (tp gathered)
        got.update(out["params"])
    names = [name for name, _ in _model(family, window).named_parameters()]  # a tied head's copy dropped
    assert set(names) <= set(got), sorted(set(names) - set(got))
    got = {name: got[name] for name in names}
    assert {t.dtype for t in got.values()} == {DTYPE}
    worst = assert_params_close(got, _reference(family, window, _pieces(layout)), TOL, f"{family} {layout}")
    print(f"{family} {layout}: max relative error {worst:.2e}")
    assert all(out["losses"] == run[0]["losses"] for out in run)


# ------------------------------------------------------------------------------------ refusals before workers
def _meta(family: str, **changes: Any) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(zoo_config(family, LAYERS, **changes))


@pytest.mark.parametrize(("family", "changes", "parallel", "words"), [
    ("gemma2", {}, {"cp": 2}, "--cp 2: context parallel is not supported for model_type 'gemma2': its attention takes "
                              "attention logit soft-capping (softcap)"),
    ("gemma3_text", {"sliding_window": 16}, {"cp": 2}, "--cp 2: context parallel is not supported for model_type "
     "'gemma3_text': its attention has a sliding window of 16 tokens (sliding_window), narrower than the 32-token "
     "sequence"),
    ("gpt_oss", {}, {"cp": 2}, "its attention takes attention sinks (s_aux)"),
    ("llama", {"attention_dropout": 0.1}, {"cp": 4}, "--cp 4: context parallel is not supported for model_type "
     "'llama': its attention has dropout 0.1 while training"),
    ("doge", {}, {"cp": 2}, "its attention applies a mask of its own"),
    ("gemma4_text", {}, {"pp": 2}, "--pp 2: pipeline parallel is not supported for model_type 'gemma4_text': "
     "'model.embed_tokens_per_layer', 'model.per_layer_model_projection', 'model.per_layer_projection_norm' hold "
     "parameters outside its pipeline plan"),
], ids=["softcap", "narrow-window", "sinks", "dropout", "own-mask", "pp-outside-plan"])
def test_launcher_refuses_in_one_line(family: str, changes: dict[str, Any], parallel: dict[str, int],
                                      words: str) -> None:
    model = _meta(family, **changes)
    with pytest.raises(UserError) as refused:
        check_family_supports(model, ParallelConfig(**parallel), seq_len=32)
    assert "\n" not in str(refused.value) and words in str(refused.value), str(refused.value)
    assert model.config._attn_implementation not in ("ndtrain_ring",)  # the probe left the model as built


def test_launcher_accepts_what_the_ring_does() -> None:
    """A window as wide as the sequence is full causal; Gemma's query_pre_attn_scalar is the ring's scale;
    every pipeline and context-parallel family of the 14 but Gemma2 (soft-capping) passes both checks."""
    check_family_supports(_meta("gemma3_text", sliding_window=32), ParallelConfig(cp=2), seq_len=32)
    for family in FAMILIES:
        check_family_supports(_meta(family), ParallelConfig(pp=2, cp=1 if family == "gemma2" else 2), seq_len=32)


def test_what_one_attention_call_may_ask_of_the_ring() -> None:
    """The check each ring attention call makes (the launcher's and the workers'): a window as wide as the
    sequence, causal attention and keywords that are not the attention's pass; the rest is named."""
    attention = _meta("llama").model.layers[0].self_attn
    check_attention_call(attention, 2, 32, None, {"dropout": 0.0, "sliding_window": 32, "is_causal": True,
                                                  "position_ids": torch.arange(32), "use_cache": False})
    start = "--cp 2: context parallel is not supported for model_type 'llama': its attention "
    for kwargs, mask, words in (
        ({"is_causal": False}, None, "is not causal (is_causal=False)"),
        ({"sliding_window": 31}, None, "has a sliding window of 31 tokens (sliding_window), narrower than the "
                                       "32-token sequence"),
        ({"position_bias": torch.zeros(1)}, None, "takes the keyword 'position_bias'"),
        ({}, torch.zeros(1), "applies a mask of its own"),
    ):
        with pytest.raises(UserError) as refused:
            check_attention_call(attention, 2, 32, mask, kwargs)
        assert str(refused.value).startswith(start + words), str(refused.value)
