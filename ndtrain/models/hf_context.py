"""Context parallel on a Hugging Face causal LM: its attention routed through ring attention (parallel/model/context.py).

transformers 5 looks each attention call up by `config._attn_implementation` in its
`AttentionInterface` registry and calls it with the attention module, q [B, H, s, h] (RoPE
applied), k and v [B, K, s, h] (GQA heads not repeated), the mask and `scaling=`; it expects
[B, s, H, h] back. `apply_hf_context_parallel` registers one stateless function under
"ndtrain_ring" (idempotent: the registry is transformers' own) that reads the `Ring` (cp group)
from the attention module it is given, stores this model's ring on each of its decoder layers'
attention modules, and switches this model (and only it) to that implementation. The function
ignores the mask: ring attention is causal over the load-balanced chunks by construction, and
`create_causal_mask` builds none for an implementation it does not know.

Positions: each cp rank holds a non-contiguous set of T/cp positions; the engine passes them as
`position_ids` through the `CausalLM` adapter, so RoPE (Llama/Qwen2) and GPT-2's learned position
embeddings see the global positions. Costs: those of ring attention (parallel/model/context.py), per layer.
Refused in one line: families ndtrain has no spec for, sliding-window attention (Qwen2's
`use_sliding_window`: the ring is full causal), and attention dropout while training.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ndtrain.errors import UserError
from ndtrain.models.hf_families import family_of, hf_config, hf_model
from ndtrain.parallel.model.context import Ring, ring_attention

ATTENTION_NAME = "ndtrain_ring"
_RING = "_ndtrain_ring"


def _ring_attention_forward(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    dropout: float = 0.0, scaling: float | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The AttentionInterface function: causal ring attention over the ring stored on `module`."""
    if dropout > 0:
        raise UserError(f"context parallel needs attention dropout 0, got {dropout}: set the model config's "
                        "attention dropout (attention_dropout / attn_pdrop) to 0")
    out = ring_attention(query, key, value, getattr(module, _RING), scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def apply_hf_context_parallel(model: nn.Module, ring: Ring) -> nn.Module:
    """Route every decoder-layer attention of the HF `model` (or its `CausalLM` adapter) through ring attention."""
    from transformers import AttentionInterface

    config = hf_config(model)
    family = family_of(model)
    if family is None:
        raise UserError(f"context parallel is not supported for Hugging Face model_type {config.model_type!r}: its "
                        "config declares no pipeline plan (base_model_pp_plan) naming its layers; use dp/ZeRO")
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise UserError(f"context parallel is not supported with sliding-window attention ({config.model_type} "
                        "layer_types): set use_sliding_window=false in the model config, or use cp=1")
    AttentionInterface.register(ATTENTION_NAME, _ring_attention_forward)
    for layer in model.get_submodule(family.layers):
        setattr(layer.get_submodule(family.attention), _RING, ring)
    hf_model(model).set_attn_implementation(ATTENTION_NAME)  # type: ignore[union-attr]
    return model
