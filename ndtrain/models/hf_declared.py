"""A Hugging Face family's structure and tensor-parallel plan read from what transformers declares.

transformers states, per family, on the config class:
- `base_model_pp_plan`: the base model's children in forward order, each with what flows in and out,
  e.g. Llama `{"embed_tokens": (["input_ids"], ["inputs_embeds"]), "layers": (["hidden_states",
  "attention_mask"], ["hidden_states"]), "norm": (["hidden_states"], ["hidden_states"])}`; GPT-NeoX
  adds `emb_dropout` between its embedding and layers;
- `base_model_tp_plan`: module pattern (relative to the base model) → style, e.g.
  `"layers.*.self_attn.q_proj": "colwise"`, Phi-3's fused `qkv_proj` as `colwise_gather_output`,
  Mixtral's expert tensors as `packed_colwise` / `rowwise` under a `moe_tp_experts` module, Qwen3's
  per-head `q_norm` as `replicated_with_grad_allreduce`.

`declared_family(model)` turns those into a `Family` record (hf_families.py), with names relative to
the `*ForCausalLM`: the first pp-plan entry is the token embedding, the entry taking `hidden_states`
and `attention_mask` is the decoder-layer list, entries between them (dropout) run on the embedding
output, the last entry is the final norm; the head is the module `get_output_embeddings()` returns
(tied to the embedding when the config says so), RoPE's tables come from the base model's
`rotary_emb` when it has one, and the attention module is the decoder layer's child whose class
name ends in "Attention". The tp plan is the declared one prefixed by the base model's name, plus
ndtrain's vocab-parallel embedding and head (the loss is computed on vocabulary shards: the
declared `colwise_gather_output` head would gather the logits first). Declared styles are mapped to
ndtrain's names by `DECLARED_STYLES` (parallel/model/tp_styles.py implements each); a style ndtrain
does not implement makes the plan a one-line refusal naming it. A declared pattern may match nothing
in a given model (Qwen2-MoE's `layers.*.mlp.gate_proj` names the dense MLP of `mlp_only_layers`, not
the shared expert, `mlp.shared_expert.gate_proj`, which stays replicated): the spec drops those
(`applicable_plan`). Also here: `softcap_logits`, the final-logit soft-capping a config declares
(Gemma2), for whoever computes logits without the model's own forward (a pipeline's last stage).
Nothing here communicates or changes the model.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn

from ndtrain.models.hf_family import Family

# transformers' style → ndtrain's (parallel/model/tp_plan.py STYLES)
DECLARED_STYLES: dict[str, str] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "embedding_rowwise": "vocab",                 # split over the vocabulary (the rows of the table)
    "colwise_gather_output": "colwise_gather_output",
    "rowwise_split_input": "rowwise_split_input",
    "packed_colwise": "packed_colwise",
    "moe_tp_experts": "moe_tp_experts",
    "replicated_with_grad_allreduce": "replicate_grad_sum",
}


def _base(model: nn.Module) -> tuple[str, nn.Module]:
    """(name, module) of the base model inside the `*ForCausalLM` (`base_model_prefix`)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    return (prefix, base) if isinstance(base, nn.Module) else ("", model)


def _module_name(root: nn.Module, target: nn.Module | None) -> str | None:
    if target is None:
        return None
    return next((name for name, module in root.named_modules() if module is target), None)


def _attention(layer: nn.Module) -> tuple[str, nn.Module] | None:
    return next(((name, child) for name, child in layer.named_children()
                 if type(child).__name__.endswith("Attention")), None)


def declared_tp_plan(config: Any, base: str, embedding: str, head: str) -> tuple[dict[str, str] | None, str]:
    """(plan relative to the `*ForCausalLM`, refusal): the declared plan in ndtrain's styles, or None and why."""
    declared = getattr(config, "base_model_tp_plan", None)
    if not declared:
        return None, (f"tensor parallel is not supported for model_type {config.model_type!r}: its config declares "
                      "no tensor-parallel plan (base_model_tp_plan); use dp/ZeRO, pp or cp")
    unknown = sorted({style for style in declared.values() if style not in DECLARED_STYLES})
    if unknown:
        return None, (f"tensor parallel is not supported for model_type {config.model_type!r}: its declared plan uses "
                      f"style {', '.join(unknown)}, which ndtrain does not implement; use dp/ZeRO, pp or cp")
    prefix = f"{base}." if base else ""
    plan = {prefix + pattern: DECLARED_STYLES[style] for pattern, style in declared.items()}
    plan.setdefault(embedding, "vocab")
    plan[head] = "vocab"
    return plan, ""


def applicable_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The entries of `plan` whose pattern matches some module or parameter of `model`."""
    names = [name for name, _ in model.named_modules()] + [name for name, _ in model.named_parameters()]
    return {pattern: style for pattern, style in plan.items()
            if any(fnmatch.fnmatchcase(name, pattern) for name in names)}


def softcap_logits(config: Any, logits: torch.Tensor) -> torch.Tensor:
    """`logits` soft-capped as the family's `*ForCausalLM` forward does when its config sets
    `final_logit_softcapping` (c·tanh(logits / c), Gemma2), else unchanged. Element-wise, so it applies
    to a vocabulary shard as to the whole: under tp the head's shard is capped before the vocab-parallel loss."""
    cap = getattr(config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def declared_family(model: nn.Module) -> Family | None:
    """The family record of a `*ForCausalLM` whose config declares `base_model_pp_plan`; None otherwise."""
    config = getattr(model, "config", None)
    pp_plan = getattr(config, "base_model_pp_plan", None)
    if not pp_plan:
        return None
    base_name, base = _base(model)
    prefix = f"{base_name}." if base_name else ""
    names = list(pp_plan)
    layer_index = next((i for i, name in enumerate(names)
                        if "attention_mask" in pp_plan[name][0] and isinstance(getattr(base, name, None), nn.ModuleList)),
                       None)
    head = _module_name(model, model.get_output_embeddings()) if hasattr(model, "get_output_embeddings") else None
    if layer_index is None or layer_index == 0 or head is None or len(getattr(base, names[layer_index])) == 0:
        return None
    layers = getattr(base, names[layer_index])
    attention = _attention(layers[0])
    if attention is None:
        return None
    embedding = prefix + names[0]
    between = names[1:layer_index]
    final = names[layer_index + 1:]
    kv = tuple(n for n in ("k_proj", "v_proj") if isinstance(getattr(attention[1], n, None), nn.Linear))
    tied = getattr(config, "tie_word_embeddings", False)
    plan, refusal = declared_tp_plan(config, base_name, embedding, head)
    return Family(
        model_type=config.model_type,
        embeddings=(embedding,),
        layers=prefix + names[layer_index],
        final_norm=prefix + final[-1] if final else "",
        head=head,
        attention=attention[0],
        kv_projections=kv if len(kv) == 2 else (),
        tied={f"{head}.weight": f"{embedding}.weight"} if tied else {},
        tp_plan=plan,
        tp_refusal=refusal,
        rotary=prefix + "rotary_emb" if isinstance(getattr(base, "rotary_emb", None), nn.Module) else None,
        embed_dropout=prefix + between[0] if between else None,
    )
