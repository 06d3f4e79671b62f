"""Tensor parallel from the plans transformers declares: every style the 14 families use, parity with one process.

Families (tests/helpers/hf_zoo.py: hidden 64, 2 layers, seeded, float64, no downloads) train 5 steps
of AdamW under tp=2 on 2 gloo processes, with sequence parallelism (`tp2_sp`) and without (`tp2`), and
must end at the parameters of single-process training on the whole global batch (relative error
≤ 1e-5, tests/helpers/hf.py's TOL; the Gemma families, whose RMSNorm multiplies by its weight in
fp32, sit near 1e-6 under sequence parallelism, the others near 1e-12 or below). One spawn per (layout, CI or slow set)
trains all its families. In CI: tp2_sp for Llama (colwise/rowwise), Phi-3 (colwise_gather_output /
rowwise_split_input), GPT-NeoX (per-head fused query_key_value), GPT-2 (hand-written plan: Conv1D,
c_attn split per q/k/v), Qwen3 (replicate_grad_sum q_norm/k_norm) and Mixtral (moe_tp_experts with
packed_colwise / rowwise expert tensors); the other families and the tp2 layout are slow.
Five families no other test names (slow, tp2_sp) check what the declared plans of untested families
need: Apertus (a learned activation's parameters inside the split MLP: gradient summed over tp), CodeGen
(qkv_proj in 4 blocks its forward divides `embed_dim` by: widths stay global), MiniMax-M2 (gathered
q/k/v into fp32 norms, an fp32 router), ERNIE-4.5-MoE (a split shared expert called on flattened tokens)
and Seed-OSS (biased q/k/v). Each CI case also checks what each rank holds of the family's split tensors; GPT-2's and Mixtral's
runs are saved as checkpoints (their packed shards: `Shard.blocks`) and loaded by one process, which
must find the same parameters and, one step later, the reference's sixth step (optimizer state placed right).

Single process (fake tp context, no collectives): the packed and fused splits slice the right rows,
checkpoint boxes of a packed shard land where the full tensor has them, head counts become local
only where the attention is split per head, the scaled embedding keeps its scale and padding row,
Gemma2's soft-cap is what the model's own forward applies, and refusals are one line naming `--tp`.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from ndtrain.config import ParallelConfig  # noqa: E402
from ndtrain.dist.mesh import ParallelContext, init  # noqa: E402
from ndtrain.engine import Engine  # noqa: E402
from ndtrain.errors import UserError  # noqa: E402
from ndtrain.models.causal_lm import CausalLM  # noqa: E402
from ndtrain.parallel.model.tp_plan import parallelize  # noqa: E402
from ndtrain.parallel.placement import Shard, placement_of  # noqa: E402
from tests.helpers.hf import DTYPE, STEPS, TOL, adamw, batch  # noqa: E402
from tests.helpers.hf_zoo import FAMILIES, zoo_model  # noqa: E402
from tests.helpers.models import fake_tp_ctx  # noqa: E402
from tests.helpers.parity import assert_params_close  # noqa: E402
from tests.helpers.reference import decay_groups, train_reference  # noqa: E402
from tests.helpers.runner import Spawns, case_result, init_method, run_each  # noqa: E402

LAYOUTS = {"tp2_sp": {"tp": 2, "sequence_parallel": True}, "tp2": {"tp": 2}}
CI = ("llama", "phi3", "gpt_neox", "gpt2", "qwen3", "mixtral")
SAVED = ("gpt2", "mixtral")  # packed shards in checkpoints
LOCAL_SHAPES: dict[str, dict[str, tuple[int, ...]]] = {  # what each rank holds of some parameters (layer 0)
    "llama": {"hf.model.layers.0.self_attn.q_proj.weight": (32, 64), "hf.model.layers.0.mlp.down_proj.weight": (64, 64),
              "hf.model.embed_tokens.weight": (128, 64)},
    "phi3": {"hf.model.layers.0.self_attn.qkv_proj.weight": (64, 64), "hf.model.layers.0.mlp.gate_up_proj.weight": (128, 64),
             "hf.model.layers.0.self_attn.o_proj.weight": (64, 32)},
    "gpt_neox": {"hf.gpt_neox.layers.0.attention.query_key_value.weight": (96, 64),
                 "hf.gpt_neox.layers.0.attention.query_key_value.bias": (96,)},
    "gpt2": {"hf.transformer.h.0.attn.c_attn.weight": (64, 96), "hf.transformer.h.0.attn.c_proj.weight": (32, 64),
             "hf.transformer.h.0.mlp.c_fc.weight": (64, 128), "hf.transformer.wpe.weight": (64, 64)},
    "qwen3": {"hf.model.layers.0.self_attn.q_norm.weight": (16,), "hf.model.layers.0.self_attn.k_proj.weight": (16, 64)},
    "mixtral": {"hf.model.layers.0.mlp.experts.gate_up_proj": (4, 128, 64),
                "hf.model.layers.0.mlp.experts.down_proj": (4, 64, 64), "hf.model.layers.0.mlp.gate.weight": (4, 64)},
}


EXTRA = ("apertus", "codegen", "minimax_m2", "ernie4_5_moe", "seed_oss")  # tp2_sp, slow
_EXTRA_SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0, bos_token_id=0,
                    eos_token_id=0, num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    n_shared_experts=1, rotary_dim=8, tie_word_embeddings=False, attention_dropout=0.0,
                    residual_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _model(family: str) -> nn.Module:
    """A zoo family's model, or one of `EXTRA` built the same way (seeded, float64, eager experts)."""
    if family not in EXTRA:
        return zoo_model(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(family, **_EXTRA_SIZES))
    if hasattr(hf, "set_experts_implementation"):
        hf.set_experts_implementation("eager")  # grouped_mm takes no float64
    return CausalLM(hf).to(DTYPE)


def _cases() -> list[Any]:
    return [pytest.param(family, layout, id=f"{family}-{layout}",
                         marks=[] if layout == "tp2_sp" and family in CI else [pytest.mark.slow])
            for layout in LAYOUTS for family in FAMILIES + (EXTRA if layout == "tp2_sp" else ())]


# ------------------------------------------------------------------------------------ workers
def _train(ctx: ParallelContext, parallel: ParallelConfig, family: str, root: str | None) -> dict[str, Any]:
    engine = Engine(lambda: _model(family), adamw, ctx, parallel)
    before = ctx.comm.stats.snapshot()
    for step in range(STEPS):
        engine.train_step([batch(step)])
    ops = {op for op, v in ctx.comm.stats.snapshot().items() if v != before.get(op)}
    out = {"params": engine.full_state_dict(), "ops": ops,
           "shapes": {name: tuple(p.shape) for name, p in engine.model.named_parameters()}}
    if root is not None and family in SAVED:
        engine.save(f"{root}/{family}")
    return out


def _suite(layout: str, families: list[str], root: str | None) -> dict[Any, Any]:
    parallel = ParallelConfig(**LAYOUTS[layout])
    ctx = init(parallel, init_method=init_method())
    return run_each(lambda family: _train(ctx, parallel, family, root), families)


@pytest.fixture(scope="module")
def spawns() -> Spawns:
    return Spawns(_suite, timeout=600)


def _run(spawns: Spawns, family: str, layout: str, root: Path) -> list[Any]:
    ci = layout == "tp2_sp" and family in CI
    families = [f for f in FAMILIES + (EXTRA if layout == "tp2_sp" else ()) if (layout == "tp2_sp" and f in CI) == ci]
    run = spawns.get((layout, ci), 2, layout, families, str(root) if ci else None)
    return case_result(run, family)


@functools.cache
def _reference(family: str, steps: int = STEPS) -> dict[str, torch.Tensor]:
    model = _model(family)
    return train_reference(model, adamw(decay_groups(model)), map(batch, range(steps)), pieces=1).params


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("declared_tp")


# ------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize(("family", "layout"), _cases())
def test_family_under_tp_matches_one_process(family: str, layout: str, one_thread: None, spawns: Spawns,
                                             root: Path) -> None:
    outs = _run(spawns, family, layout, root)
    ref = _reference(family)
    for rank, out in enumerate(outs):
        got = {name: out["params"][name] for name in ref}
        assert {t.dtype for t in got.values()} == {DTYPE}
        assert_params_close(got, ref, TOL, f"{family} {layout} rank {rank}")
        if "sp" in layout:  # sequence parallelism: all-gather + reduce-scatter around the layers' tp work
            assert {"all_gather/tp", "reduce_scatter/tp"} <= out["ops"], out["ops"]
        else:
            assert "all_reduce/tp" in out["ops"] and "reduce_scatter/tp" not in out["ops"], out["ops"]
        for name, shape in LOCAL_SHAPES.get(family, {}).items():
            assert out["shapes"][name] == shape, (name, out["shapes"][name])


@pytest.mark.parametrize("family", SAVED)
def test_packed_shards_checkpoint_to_one_process(family: str, one_thread: None, spawns: Spawns, root: Path) -> None:
    """A tp2+sp checkpoint of packed/fused shards loads in one process: the same parameters, and one
    more step lands on the reference's sixth (the optimizer state came back in place too)."""
    out = _run(spawns, family, "tp2_sp", root)[0]
    ctx = init(ParallelConfig())
    engine = Engine(lambda: zoo_model(family), adamw, ctx, ParallelConfig())
    assert engine.load(str(root / family))["step"] == STEPS
    loaded = engine.full_state_dict()
    assert_params_close({k: loaded[k] for k in _reference(family)}, {k: out["params"][k] for k in _reference(family)},
                        0.0, f"{family} loaded")
    engine.train_step([batch(STEPS)])
    after = engine.full_state_dict()
    assert_params_close({k: after[k] for k in _reference(family)}, _reference(family, STEPS + 1), TOL,
                        f"{family} step {STEPS + 1} after loading")


# ------------------------------------------------------------------------------------ single process
def _split(family: str, tp: int = 2, **changes: Any) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    model = zoo_model(family, **changes)
    full = {k: v.clone() for k, v in model.state_dict().items()}
    parallelize(model, fake_tp_ctx(tp))
    return model, full


def test_packed_and_fused_projections_split_per_block() -> None:
    """Rank 0 of 2 holds the first half of each packed block: Mixtral's gate and up, GPT-2's q, k and v."""
    model, full = _split("mixtral")
    experts = model.hf.model.layers[0].mlp.experts
    gate_up = full["hf.model.layers.0.mlp.experts.gate_up_proj"]  # [E, 2I, d], I = 128
    assert torch.equal(experts.gate_up_proj, torch.cat([gate_up[:, :64], gate_up[:, 128:192]], dim=1))
    assert torch.equal(experts.down_proj, full["hf.model.layers.0.mlp.experts.down_proj"][..., :64])
    assert experts.intermediate_dim == 64
    assert placement_of(experts.gate_up_proj).tp == Shard(1, 0, 128, 256, blocks=2)
    model, full = _split("gpt2")
    attention = model.hf.transformer.h[0].attn
    c_attn = full["hf.transformer.h.0.attn.c_attn.weight"]  # Conv1D [in, out]: out = q | k | v, 64 each
    assert torch.equal(attention.c_attn.weight, torch.cat([c_attn[:, :32], c_attn[:, 64:96], c_attn[:, 128:160]], 1))
    assert torch.equal(attention.c_proj.weight, full["hf.transformer.h.0.attn.c_proj.weight"][:32])
    assert (attention.num_heads, attention.split_size, attention.embed_dim) == (2, 32, 64)  # its forward reads split_size


def test_checkpoint_boxes_of_a_packed_shard_land_in_place() -> None:
    """Every box of a packed shard's run (a ZeRO-like partial range) views local values that the full
    tensor holds at the box's global offsets, and the boxes cover the range exactly once."""
    from ndtrain.checkpoint.slices import Run, boxes

    whole = torch.arange(2 * 8 * 3, dtype=torch.float64).view(2, 8, 3)  # [E, 2I, d], I = 4, tp = 2, rank 1
    local = torch.cat([whole[:, 2:4], whole[:, 6:8]], dim=1)
    shard = Shard(1, 2, 4, 8, blocks=2)
    run = Run("p", (2, 8, 3), shard, (2, 4, 3), 5, 19, local.flatten(), 5, True)  # owner: the flat local tensor
    covered = 0
    for box in boxes(run):
        index = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
        assert torch.equal(box.view(run.owner), whole[index]), box
        covered += box.view(run.owner).numel()
    assert covered == 19 - 5 and len(boxes(run)) > 2  # the range crosses blocks


def test_head_counts_become_local_only_where_attention_is_split() -> None:
    llama, _ = _split("llama")
    assert llama.hf.model.layers[0].self_attn.num_key_value_groups == 2  # 2 local query heads, 1 local kv head
    phi3, _ = _split("phi3")  # q/k/v gathered: the attention runs whole, config-sized
    attention = phi3.hf.model.layers[0].self_attn
    assert (attention.num_key_value_groups, attention.num_key_value_heads) == (2, 2)
    assert attention.qkv_proj.gather_output and attention.o_proj.split_input


def test_scaled_embedding_keeps_its_scale_and_padding_row() -> None:
    model, full = _split("gemma")
    embedding = model.hf.model.embed_tokens
    assert embedding.embed_scale.item() == pytest.approx(64 ** 0.5) and embedding.padding_idx == 0
    assert torch.equal(embedding.weight, full["hf.model.embed_tokens.weight"][:128])


def test_softcap_is_the_models_own() -> None:
    """`softcap_logits` (for a pipeline's last stage) caps as Gemma2's forward does, shard by shard alike."""
    from ndtrain.models.hf_declared import softcap_logits

    model = zoo_model("gemma2")
    tokens, _ = batch(0)
    hidden = model.hf.model(input_ids=tokens).last_hidden_state
    raw = model.hf.lm_head(hidden)
    assert model.hf.config.final_logit_softcapping == 30.0
    assert torch.equal(softcap_logits(model.hf.config, raw), model(tokens))
    halves = [softcap_logits(model.hf.config, part) for part in raw.chunk(2, dim=-1)]
    assert torch.equal(torch.cat(halves, dim=-1), model(tokens))
    assert softcap_logits(zoo_model("llama").hf.config, raw) is raw


@pytest.mark.parametrize(("family", "tp", "changes", "message"), [
    ("mixtral", 2, {"intermediate_size": 65}, r"^--tp 2: 'hf.model.layers.0.mlp.experts.gate_up_proj' packs gate "
                                              r"and up of 65 intermediate features per expert, not divisible by tp=2"),
    ("gpt2", 2, {"n_head": 1}, r"^--tp 2: config.num_attention_heads=1 is not divisible by tp=2"),
    ("phi3", 3, {}, r"^--tp 3: tp plan: 'hf.model.layers.0.self_attn.qkv_proj' has 128 output features, "
                    r"not divisible by tp=3"),
    ("gpt_neox", 3, {}, r"^--tp 3: tp plan: 'hf.gpt_neox.layers.0.attention.dense' has 64 input features"),
])
def test_what_tp_cannot_divide_is_refused_in_one_line(family: str, tp: int, changes: dict, message: str) -> None:
    with pytest.raises(UserError, match=message) as error:
        _split(family, tp, **changes)
    assert "\n" not in str(error.value)


def test_plans_that_would_split_experts_wrongly_are_refused() -> None:
    experts = "hf.model.layers.*.mlp.experts"
    base = {"hf.model.embed_tokens": "vocab", "hf.lm_head": "vocab"}
    cases = [
        ({**base, f"{experts}.gate_up_proj": "packed_colwise"}, "its module is not moe_tp_experts"),
        ({**base, f"{experts}.gate_up_proj": "packed_colwise", experts: "moe_tp_experts"}, "leaves its down_proj whole"),
        ({**base, f"{experts}.gate_up_proj": "colwise_gather_output", f"{experts}.down_proj": "rowwise",
          experts: "moe_tp_experts"}, "a parameter may be packed_colwise or rowwise"),
        ({**base, "hf.model.layers.*.mlp.gate": "moe_tp_experts"}, "leaves its weight whole"),
    ]
    for plan, words in cases:
        with pytest.raises(UserError, match=words) as error:
            parallelize(zoo_model("mixtral"), fake_tp_ctx(2), plan)
        assert str(error.value).startswith("--tp 2: ") and "\n" not in str(error.value)


def test_an_embedding_with_its_own_forward_is_refused() -> None:
    class Shifted(nn.Embedding):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return super().forward(tokens) + 1.0

    model = nn.Sequential(Shifted(8, 4), nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(UserError, match=r"^--tp 2: tp plan: vocab '0': the embedding is a Shifted, whose forward"):
        parallelize(model, fake_tp_ctx(2), {"0": "vocab", "1.0": "colwise"})


def test_replicated_parameters_get_the_gradient_sum_their_block_needs() -> None:
    """Without sequence parallelism: a parameter inside a block whose column layers split their output
    (a learned activation) is summed over tp; one inside a block whose column layers gather theirs
    (OLMo2's q_norm) or outside any block (a norm) is complete on every rank."""

    class Learned(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.alpha = nn.Parameter(torch.ones(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.alpha * x

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.act, self.down = nn.Linear(8, 16), Learned(), nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(self.act(self.up(x)))

    model = nn.Sequential(nn.Embedding(10, 8), Block(), Block(), nn.LayerNorm(8))
    plan = {"0": "vocab", "1.up": "colwise", "1.down": "rowwise", "2.up": "colwise_gather_output",
            "2.down": "rowwise_split_input"}
    parallelize(model, fake_tp_ctx(2), plan)
    hooked = {name for name, p in model.named_parameters() if p._backward_hooks}
    assert hooked == {"1.act.alpha"}
    olmo2, _ = _split("olmo2")
    assert not any(p._backward_hooks for p in olmo2.hf.model.layers[0].self_attn.q_norm.parameters())


def test_sequence_parallel_with_an_attention_left_whole_is_refused() -> None:
    """GPT-OSS declares only its embedding: under sequence parallelism its attention would see a shard."""
    config = transformers.AutoConfig.for_model("gpt_oss", **{**_EXTRA_SIZES, "num_hidden_layers": 1})
    model = CausalLM(transformers.AutoModelForCausalLM.from_config(config))
    with pytest.raises(UserError, match=r"^--tp 2: sequence parallelism needs every layer's attention split by the "
                                        r"tp plan, but hf.model.layers.0.self_attn \(GptOssAttention\) is left whole"):
        parallelize(model, fake_tp_ctx(2), sequence_parallel=True)
    parallelize(CausalLM(transformers.AutoModelForCausalLM.from_config(config)), fake_tp_ctx(2))  # without: fine


def test_a_per_head_parameter_the_plan_keeps_whole_is_refused() -> None:
    """Doge's attention holds `A`, one value per kv head, which its declared plan does not split."""
    config = transformers.AutoConfig.for_model("doge", **{**_EXTRA_SIZES, "num_hidden_layers": 1})
    model = CausalLM(transformers.AutoModelForCausalLM.from_config(config))
    with pytest.raises(UserError, match=r"^--tp 2: hf.model.layers.0.self_attn.A holds one value per attention head "
                                        r"\(shape \[2\]\) and the tp plan does not split it"):
        parallelize(model, fake_tp_ctx(2))
