"""Where the parts of a Hugging Face causal LM are: read from its declared plans (hf_declared.py), by hand for GPT-2.

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

from typing import Any

from torch import nn

from ndtrain.models.hf_declared import declared_family
from ndtrain.models.hf_family import Family
from ndtrain.parallel.model_spec import largest_block_list


FAMILIES: dict[str, Family] = {  # hand-written only where transformers declares no plans
    "gpt2": Family(
        model_type="gpt2", embeddings=("transformer.wte", "transformer.wpe"), layers="transformer.h",
        final_norm="transformer.ln_f", head="lm_head", attention="attn",
        tied={"lm_head.weight": "transformer.wte.weight"}, positions="transformer.wpe", embed_dropout="transformer.drop",
        # Conv1D weights are [in, out]; c_attn's output is [q | k | v], split per third so that each rank
        # holds the same heads' q, k and v; wpe stays whole (positions are not split)
        tp_plan={"transformer.wte": "vocab", "lm_head": "vocab", "transformer.h.*.attn.c_attn": "qkv_colwise",
                 "transformer.h.*.attn.c_proj": "rowwise", "transformer.h.*.mlp.c_fc": "colwise",
                 "transformer.h.*.mlp.c_proj": "rowwise"},
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
    known = FAMILIES.get(config.model_type) or declared_family(hf_model(model))  # type: ignore[arg-type]
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
