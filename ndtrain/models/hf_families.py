"""Where the parts of a Hugging Face causal LM are, per family (keyed by `config.model_type`).

The parallel strategies need to know a model's structure, not guess it from names: ZeRO-3 wraps
each decoder layer as a unit, recompute checkpoints each layer (or its attention), tensor
parallel applies the family's plan, and a pipeline cut or context parallel needs the
embedding(s), the layer list, the final norm, the head and how a layer is called (its inputs:
RoPE tables from the rotary module, or learned positions added to the embeddings). A `Family`
records those as module names relative to the transformers `*ForCausalLM` (the `CausalLM`
adapter's `.hf`); `family_of` prefixes them with `hf.` for the adapter.

How HF calls a decoder layer (transformers 5.x): the hidden states [B, T, d] first and
positionally, everything else by keyword (Llama/Qwen2: attention_mask=, position_embeddings=
(cos, sin) computed once by the model's rotary module, position_ids=, past_key_values=,
use_cache=; GPT-2: past_key_values, attention_mask and encoder states positionally, then
keywords). A layer returns the new hidden states (one tensor). Inside a layer the attention
module is called with `hidden_states=` as a keyword, which is why hooks that rewrite a module's
input must look at keyword arguments too (`Family.layer_input`).

The strategies read none of this directly: the family's spec (hf_parallel.py, a `ModelParallel`)
answers them from it. For a model of no listed family `decoder_layers` falls back to the largest
`nn.ModuleList` of identical block classes (`model_spec.largest_block_list`, the rule the base spec
applies to any model); tensor parallel then needs a plan given by the user (`Engine(..., tp_plan=...)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ndtrain.parallel.model_spec import largest_block_list

_LLAMA_LIKE_PLAN: dict[str, str] = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.layers.*.input_layernorm": "replicate",
    "model.layers.*.post_attention_layernorm": "replicate",
    "model.norm": "replicate",
    "lm_head": "vocab",
}


@dataclass(frozen=True)
class Family:
    """Module names (relative to the `*ForCausalLM`) of one family's parts, and its tp support."""

    model_type: str
    embeddings: tuple[str, ...]     # token embedding first, then any others (GPT-2's positions)
    layers: str                     # the decoder-layer nn.ModuleList
    final_norm: str
    head: str
    attention: str                  # the attention module inside one layer
    kv_projections: tuple[str, ...] = ()  # children of `attention` projecting keys and values
    tied: dict[str, str] = field(default_factory=dict)  # head weight → embedding weight when tie_word_embeddings
    layer_input: str = "hidden_states"  # keyword name of a layer's / attention's input when not positional
    tp_plan: dict[str, str] | None = None  # module pattern → style (tp_plan.py); None: tp refused
    tp_refusal: str = ""            # why tp is refused, when it is
    # how the model prepares a layer's inputs (pipeline stages repeat it per stage):
    rotary: str | None = None       # the rotary module giving position_embeddings=(cos, sin) (Llama/Qwen2)
    positions: str | None = None    # the learned position embedding added to the tokens' (GPT-2's wpe)
    embed_dropout: str | None = None  # the dropout applied to the embeddings (GPT-2's drop)


FAMILIES: dict[str, Family] = {
    name: Family(
        model_type=name, embeddings=("model.embed_tokens",), layers="model.layers", final_norm="model.norm",
        head="lm_head", attention="self_attn", kv_projections=("k_proj", "v_proj"),
        tied={"lm_head.weight": "model.embed_tokens.weight"}, tp_plan=_LLAMA_LIKE_PLAN, rotary="model.rotary_emb",
    )
    for name in ("llama", "qwen2")
} | {
    "gpt2": Family(
        model_type="gpt2", embeddings=("transformer.wte", "transformer.wpe"), layers="transformer.h",
        final_norm="transformer.ln_f", head="lm_head", attention="attn",
        tied={"lm_head.weight": "transformer.wte.weight"}, positions="transformer.wpe", embed_dropout="transformer.drop",
        tp_refusal="tensor parallel is not supported for gpt2: its fused Conv1D c_attn (q, k, v in one "
                   "[d, 3d] matrix) needs a q/k/v-aware split ndtrain does not have; use dp/ZeRO for gpt2",
    ),
}


def hf_model(model: nn.Module) -> nn.Module | None:
    """The transformers model inside `model` (the `CausalLM` adapter's `.hf`, or `model` itself), or None."""
    inner = getattr(model, "hf", model)
    return inner if hasattr(getattr(inner, "config", None), "model_type") else None


def hf_config(model: nn.Module) -> Any:
    inner = hf_model(model)
    return None if inner is None else inner.config


def _prefix(model: nn.Module) -> str:
    """"hf." when `model` is the adapter around the HF model, "" when it is the HF model."""
    return "hf." if getattr(model, "hf", None) is not None and hf_model(model) is model.hf else ""


def family_of(model: nn.Module) -> Family | None:
    """The family of an HF model (or its adapter) with names relative to `model`; None for any other
    model, HF families not listed here included (their layers are then found generically)."""
    config = hf_config(model)
    if config is None:
        return None
    prefix = _prefix(model)
    known = FAMILIES.get(config.model_type)
    if known is None:
        return None
    return Family(
        model_type=known.model_type,
        embeddings=tuple(prefix + e for e in known.embeddings),
        layers=prefix + known.layers,
        final_norm=prefix + known.final_norm,
        head=prefix + known.head,
        attention=known.attention,
        kv_projections=known.kv_projections,
        tied={prefix + k: prefix + v for k, v in known.tied.items()} if getattr(config, "tie_word_embeddings", False) else {},
        layer_input=known.layer_input,
        tp_plan=None if known.tp_plan is None else {prefix + k: v for k, v in known.tp_plan.items()},
        tp_refusal=known.tp_refusal,
        rotary=None if known.rotary is None else prefix + known.rotary,
        positions=None if known.positions is None else prefix + known.positions,
        embed_dropout=None if known.embed_dropout is None else prefix + known.embed_dropout,
    )


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """(name, list) of `model`'s decoder layers: the family's list for a known HF family, else the
    nn.ModuleList of identical block classes holding the most parameters (None if there is none)."""
    family = family_of(model)
    if family is not None:
        return family.layers, model.get_submodule(family.layers)  # type: ignore[return-value]
    return largest_block_list(model)
