"""`ndtrain plan --model hf:DIR` (plan/hf_config.py) and the planner's mixture-of-experts accounting (plan/moe.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ndtrain.errors import UserError
from ndtrain.plan import arch, hf_config
from ndtrain.plan.cli import main as plan_main
from ndtrain.plan.hardware import Cluster, gpu
from ndtrain.plan.layout import Layout
from ndtrain.plan.memory import memory
from ndtrain.plan.search import Fixed, search

CLUSTER = Cluster(gpu("h100-sxm"), 2, 8)


def _layout(tp: int = 1, dp: int = 1, zero: int = 0) -> Layout:
    return Layout(tp, 1, dp, 1, zero, 1, 1, "none", False, "none")


def _write(tmp_path: Path, config: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


LLAMA = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=1000, max_position_embeddings=512, tie_word_embeddings=False,
             hidden_act="silu")


def test_llama_config_reads_as_the_equivalent_arch_llama_spec_run_by_transformers(tmp_path: Path) -> None:
    read = hf_config.read(_write(tmp_path, LLAMA), seq=256)
    explicit = arch.explicit("llama", 4, 256, 8, 4, 688, 1000, 256)
    assert (read.arch, read.layers, read.hidden, read.heads, read.kv_heads, read.ffn, read.vocab, read.seq) == \
        ("llama", 4, 256, 8, 4, 688, 1000, 256)
    assert read.total_params == explicit.total_params
    assert read.model_flops_per_token == explicit.model_flops_per_token
    for layout in (_layout(dp=2), _layout(dp=2, zero=3), _layout(tp=2)):  # transformers' eager layers keep more
        assert memory(read, layout, CLUSTER, 2) == memory(dataclasses.replace(explicit, hf=True), layout, CLUSTER, 2)
        hf, own = memory(read, layout, CLUSTER, 2), memory(explicit, layout, CLUSTER, 2)
        assert (hf.params, hf.grads, hf.optimizer) == (own.params, own.grads, own.optimizer)
        assert hf.activations > own.activations
    fixed = Fixed(1, 1, 2, 1, 0, 1, None, "none", False, None)
    a, b = search(read, CLUSTER, 4, fixed), search(explicit, CLUSTER, 4, fixed)
    assert [c.timing for c in a.candidates] == [c.timing for c in b.candidates]


def test_seq_defaults_to_the_positions_capped(tmp_path: Path) -> None:
    assert hf_config.read(_write(tmp_path / "a", LLAMA), None).seq == 512
    assert hf_config.read(_write(tmp_path / "b", dict(LLAMA, max_position_embeddings=131072)), None).seq == \
        hf_config.SEQ_CAP


def test_gpt2_is_gpt_style_and_gemma_keeps_its_head_size(tmp_path: Path) -> None:
    gpt2 = hf_config.spec(dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64,
                               n_inner=None), "g", None)
    assert (gpt2.arch, gpt2.ffn, gpt2.tied_embeddings, gpt2.seq) == ("gpt", 256, True, 64)
    gemma = hf_config.spec(dict(LLAMA, model_type="gemma", head_dim=64, tie_word_embeddings=True,
                                hidden_act="gelu_pytorch_tanh"), "m", None)
    assert (gemma.arch, gemma.head_dim, gemma.tied_embeddings) == ("llama", 64, True)
    assert gemma.head_params == 256  # the final norm only: the output head is the embedding


MIXTRAL = dict(LLAMA, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
QWEN2_MOE = dict(LLAMA, model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                 shared_expert_intermediate_size=256, decoder_sparse_step=2, mlp_only_layers=[0], qkv_bias=True)


def test_mixtral_parameters_by_hand() -> None:
    m = hf_config.spec(MIXTRAL, "mixtral", 256)
    h, f, v, d = 256, 688, 1000, 32
    attention = h * (8 + 2 * 4) * d + 8 * d * h
    layer = attention + 4 * 3 * h * f + 4 * h + 2 * h  # 4 experts, the router, two norms
    assert m.total_params == 4 * layer + 2 * v * h + h
    assert m.active_params == m.total_params - 4 * 2 * 3 * h * f  # 2 of 4 experts unused per token
    assert m.expert_params == 4 * 4 * 3 * h * f
    assert m.layer_matrix_weights == attention + 2 * 3 * h * f + 4 * h
    assert m.token_ffn == 2 * f


def test_qwen2_moe_parameters_by_hand() -> None:
    m = hf_config.spec(QWEN2_MOE, "qwen2-moe", 256)
    h, f, fe, fs, v, d = 256, 688, 128, 256, 1000, 32
    assert m.moe is not None and m.moe.dense_layers == (0, 2)  # listed, and (i + 1) % 2 != 0
    attention = h * (8 + 2 * 4) * d + 8 * d * h + (8 + 2 * 4) * d  # q/k/v biases
    moe = 4 * 3 * h * fe + 3 * h * fs + 4 * h + h  # experts, shared expert, router, shared gate
    dense = 3 * h * f
    assert m.total_params == 2 * (attention + 2 * h + moe) + 2 * (attention + 2 * h + dense) + 2 * v * h + h
    assert m.active_params == m.total_params - 2 * 2 * 3 * h * fe
    assert m.layers_params(2, 2) == (attention + 2 * h + dense) + (attention + 2 * h + moe)
    assert m.largest_layer_params == attention + 2 * h + moe


def test_experts_split_over_tp_in_memory() -> None:
    m = hf_config.spec(MIXTRAL, "mixtral", 256)
    one, two = memory(m, _layout(), CLUSTER, 1), memory(m, _layout(tp=2), CLUSTER, 1)
    assert two.params == pytest.approx(one.params / 2)  # each expert's matrices (and every layer) / tp
    assert one.params == m.total_params * CLUSTER.hardware.precision.param_bytes  # every expert held
    dense = hf_config.spec(LLAMA, "dense", 256)
    assert one.params > memory(dense, _layout(), CLUSTER, 1).params


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2",
                                    "gpt2", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_total_parameters_equal_transformers_models(family: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from tests.helpers.hf_zoo import zoo_config

    config = zoo_config(family, layers=3)
    config.save_pretrained(str(tmp_path))
    positions = config.to_dict().get("n_positions") or config.max_position_embeddings
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert hf_config.read(tmp_path, positions).total_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("config, message", [
    (dict(LLAMA, model_type="deepseek_v3", kv_lora_rank=512), "multi-head latent attention"),
    (dict(LLAMA, model_type="ernie4_5_moe", moe_num_experts=4, moe_k=2, moe_layer_start_index=1), "moe_layer_start"),
    (dict(LLAMA, num_local_experts=4), "num_experts_per_tok"),
    (dict(LLAMA, hidden_size="big"), "hidden_size='big'"),
    ({"model_type": "llama"}, "no hidden_size"),
])
def test_unreadable_configs_are_refused_in_one_line(config: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        hf_config.spec(config, "x", 256)


def test_cli_prints_what_it_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ndtrain.cli.commands import build_parser

    folder = _write(tmp_path, MIXTRAL)
    args = build_parser().parse_args(["plan", "--model", f"hf:{folder}", "--seq", "256", "--gpus", "2",
                                      "--gpu", "h100-sxm", "--global-batch", "8", "--top", "1"])
    assert plan_main(args) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "MoE: 4 experts of width 688, 2 per token" in first and "active per token" in first
    missing = build_parser().parse_args(["plan", "--model", f"hf:{tmp_path / 'none'}", "--gpus", "2",
                                         "--gpu", "h100-sxm", "--global-batch", "8"])
    assert plan_main(missing) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_mixtral_presets_match_the_published_totals() -> None:
    small, large = arch.PRESETS["mixtral-8x7b"], arch.PRESETS["mixtral-8x22b"]
    assert round(small.total_params / 1e9, 1) == 46.7 and round(small.active_params / 1e9, 1) == 12.9
    assert round(large.total_params / 1e9) == 141 and round(large.active_params / 1e9) == 39
