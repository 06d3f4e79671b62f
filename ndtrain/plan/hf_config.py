"""`ndtrain plan --model hf:DIR`: a Hugging Face folder's config.json read into a planner `ModelSpec`.

Parsed with json only (no transformers import, nothing unpickled); the keys are the ones transformers'
configs use, first present wins:
    hidden      hidden_size | n_embd                 layers   num_hidden_layers | n_layer
    heads       num_attention_heads | n_head         kv heads num_key_value_heads (absent or null: heads)
    head size   head_dim where given and not null (else hidden/heads)
    ffn         intermediate_size | n_inner (null: 4·hidden)          vocab  vocab_size
    tied        tie_word_embeddings (absent: the family's practice, `arch.py`)
    seq         --seq, else max_position_embeddings | n_positions capped at SEQ_CAP
    dropout     any *dropout* / *pdrop* value above 0
Architecture: `gpt` (LayerNorm with biases, biases on every linear, an fc → activation → fc MLP)
for the families in NON_GATED — GPT-2 (learned positions, as `arch.py` counts them) and the NeoX-style
ones (rotary, no position table); every other family is `llama` (RMSNorm, a gated MLP). The activation
alone cannot tell (Gemma gates a GeLU, Phi-2 does not), so model_type decides. Attention is counted as
SDPA runs it for ndtrain's HF models: no score matrix stored (`flash`).
Per-layer parameters a family adds to llama's formula (`extra_layer_params`): q/k/v biases (Qwen2,
Qwen2-MoE `qkv_bias`), q/k/v/o biases (`attention_bias`), MLP biases (`mlp_bias`), per-head Q/K norms
(Qwen3, Qwen3-MoE, Gemma 3), full-width Q/K norms (OLMo 2), Gemma 2/3's two extra norms.
Mixture of experts (`moe.py`), any of these keys above 0 makes the model MoE:
    experts         num_local_experts | num_experts | n_routed_experts | moe_num_experts
    per token       num_experts_per_tok | moe_k | moe_topk
    expert width    moe_intermediate_size, else intermediate_size (Mixtral)
    shared experts  shared_expert_intermediate_size (Qwen2-MoE: one, with a sigmoid gate), or
                    n_shared_experts | moe_num_shared_experts × the expert width (DeepSeek-style, ERNIE)
    dense layers    first_k_dense_replace (the first k, DeepSeek-style); mlp_only_layers and
                    decoder_sparse_step (Qwen-MoE: layer i has experts when i is not listed and
                    (i + 1) % step == 0)
A config with other layer-placement keys (UNREAD) or multi-head latent attention (kv_lora_rank) is
refused in one line rather than guessed. Not counted: GPT-2's position rows beyond --seq when --seq is
shorter than n_positions, expert biases and attention sinks (gpt-oss), routers' score-correction biases.

Cost: reading one small JSON file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ndtrain.errors import UserError
from ndtrain.models.hf import read_hf_config
from ndtrain.plan.arch import ModelSpec
from ndtrain.plan.moe import Experts

PREFIX = "hf:"
SEQ_CAP = 4096  # a config's max_position_embeddings is what it can attend, not what it trains on
NON_GATED = ("gpt2", "gpt_neox", "gptj", "gpt_neo", "gpt_bigcode", "phi", "starcoder2", "codegen", "opt", "falcon",
             "bloom")
LEARNED_POSITIONS = ("gpt2", "gpt_neo", "gpt_bigcode", "opt")
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk")
SHARED_COUNT_KEYS = ("n_shared_experts", "moe_num_shared_experts")
UNREAD = ("moe_layer_freq", "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval")
QK_NORM_PER_HEAD = ("qwen3", "qwen3_moe", "gemma3_text", "gemma3")
QKV_BIAS = ("qwen2", "qwen2_moe")


def read(directory: Path, seq: int | None) -> ModelSpec:
    """The model of `directory`/config.json (read as `ndtrain train --model hf:DIR` reads it); `seq`
    overrides the sequence length."""
    config = read_hf_config(directory)
    return spec(config, f"hf:{directory.name}", seq)


def spec(config: dict[str, Any], name: str, seq: int | None) -> ModelSpec:
    family = str(config.get("model_type", ""))
    where = f"--model {name} ({family or 'no model_type'})"
    if config.get("kv_lora_rank"):
        raise UserError(f"{where}: multi-head latent attention (kv_lora_rank) is not modelled by the planner")
    hidden = _int(config, where, "hidden_size", "n_embd")
    heads = _int(config, where, "num_attention_heads", "n_head")
    kv_heads = _int(config, where, "num_key_value_heads", default=heads)
    head_size = _int(config, where, "head_dim", default=0) or None
    gated = family not in NON_GATED
    ffn = _int(config, where, "intermediate_size", "n_inner", default=4 * hidden)
    positions = _int(config, where, "max_position_embeddings", "n_positions", default=SEQ_CAP)
    tied = config.get("tie_word_embeddings")
    dropout = any(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                  for k, v in config.items() if "dropout" in k or "pdrop" in k)
    d = head_size or hidden // max(heads, 1)
    return ModelSpec(
        name, "llama" if gated else "gpt", _int(config, where, "num_hidden_layers", "n_layer"), hidden, heads,
        kv_heads, ffn, _int(config, where, "vocab_size"), seq or min(positions, SEQ_CAP), flash=True, dropout=dropout,
        head_size=head_size, tied=tied if isinstance(tied, bool) else None,
        extra_layer_params=_extra_layer_params(config, family, gated, hidden, heads, kv_heads, d, ffn),
        moe=_experts(config, where, hidden, ffn) if gated else _no_experts(config, where),
        learned_positions=family in LEARNED_POSITIONS if not gated else None, hf=True)


def describe(model: ModelSpec) -> str:
    """What was read, in one line: dense or MoE, total and active parameters, expert memory."""
    head = (f"{model.name}: {model.arch}-style, {model.layers} layers, h={model.hidden}, {model.heads} heads of "
            f"{model.head_dim} ({model.kv_heads} kv), ffn {model.ffn}, vocab {model.vocab}, seq {model.seq}, "
            f"{'tied' if model.tied_embeddings else 'untied'} embeddings; ")
    if model.moe is None:
        return head + f"dense, {model.total_params / 1e6:,.2f} M parameters"
    e = model.moe
    shared = f", shared width {e.shared_ffn}" if e.shared_ffn else ""
    return (head + f"MoE: {e.count} experts of width {e.ffn}, {e.top_k} per token{shared}, "
            f"{e.moe_layers(model.layers)} of {model.layers} layers with experts; {model.total_params / 1e6:,.2f} M "
            f"parameters in total (memory), {model.active_params / 1e6:,.2f} M active per token (FLOPs); "
            f"routed experts {model.expert_params / 1e6:,.2f} M parameters")


def _int(config: dict[str, Any], where: str, *keys: str, default: int | None = None) -> int:
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UserError(f"{where}: config {key}={value!r} is not a count: fix config.json")
        return value
    if default is None:
        raise UserError(f"{where}: config.json has no {' or '.join(keys)}: not a decoder config the planner reads")
    return default


def _extra_layer_params(config: dict[str, Any], family: str, gated: bool, hidden: int, heads: int, kv_heads: int,
                        d: int, ffn: int) -> int:
    if not gated:
        return 0  # the gpt formula has every bias and both LayerNorms
    qkv = (heads + 2 * kv_heads) * d
    extra = 0
    if config.get("attention_bias"):
        extra += qkv + hidden
    elif family in QKV_BIAS and config.get("qkv_bias", True):
        extra += qkv
    if config.get("mlp_bias"):
        extra += 2 * ffn + hidden
    if family in QK_NORM_PER_HEAD:
        extra += 2 * d
    if family == "olmo2":
        extra += (heads + kv_heads) * d
    if family in ("gemma2", "gemma3_text", "gemma3"):
        extra += 2 * hidden  # post-attention and post-feed-forward norms
    return extra


def _no_experts(config: dict[str, Any], where: str) -> None:
    if any(config.get(key) for key in EXPERT_KEYS):
        raise UserError(f"{where}: experts in a family without a gated MLP are not modelled by the planner")
    return None


def _experts(config: dict[str, Any], where: str, hidden: int, ffn: int) -> Experts | None:
    count = _int(config, where, *EXPERT_KEYS, default=0)
    if count == 0:
        return None
    unread = [key for key in UNREAD if key in config]
    if unread:
        raise UserError(f"{where}: the MoE layer placement key {unread[0]} is not read by the planner: "
                        "plan an equivalent --arch model")
    top_k = _int(config, where, *TOP_K_KEYS)
    width = _int(config, where, "moe_intermediate_size", default=ffn)
    shared_width = _int(config, where, "shared_expert_intermediate_size", default=0)
    shared_gate = shared_width > 0
    if not shared_width:
        shared_width = _int(config, where, *SHARED_COUNT_KEYS, default=0) * width
    layers = _int(config, where, "num_hidden_layers", "n_layer")
    return Experts(count, top_k, width, shared_width, shared_gate, _dense_layers(config, where, layers))


def _dense_layers(config: dict[str, Any], where: str, layers: int) -> tuple[int, ...]:
    first = _int(config, where, "first_k_dense_replace", default=0)
    step = _int(config, where, "decoder_sparse_step", default=1)
    listed = config.get("mlp_only_layers") or []
    if step == 0 or not isinstance(listed, list) or not all(isinstance(i, int) for i in listed):
        raise UserError(f"{where}: decoder_sparse_step={step!r} / mlp_only_layers={listed!r} cannot be read: "
                        "fix config.json")
    return tuple(i for i in range(layers) if i < first or i in listed or (i + 1) % step)
