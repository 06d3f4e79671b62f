"""Context parallel on a Hugging Face causal LM: its attention routed through ring attention (parallel/model/context.py).

transformers 5 looks each attention call up by `config._attn_implementation` in its
`AttentionInterface` registry and calls it with the attention module, q [B, H, s, h] (RoPE
applied), k and v [B, K, s, h] (GQA heads not repeated), the mask and keywords (`scaling=`,
`dropout=`, and what the family's attention needs: `sliding_window=`, `softcap=`, `s_aux=`, ...); it
expects [B, s, H, h] back. `apply_hf_context_parallel` registers one stateless function under
"ndtrain_ring" (idempotent: the registry is transformers' own) that reads the `Ring` (cp group)
from the attention module it is given, stores this model's ring on each of its decoder layers'
attention modules, and switches this model (and only it) to that implementation, whatever the
implementation it was built with (`model.attention`): under cp the ring replaces it. It works for any
family with a pipeline plan (declared or GPT-2's), none being named here. The mask is not applied:
ring attention is causal over the load-balanced chunks by construction, and `create_causal_mask`
builds none for an implementation it does not know.

What the function does with the keywords (`check_attention_call`, the same code in the launcher and the workers):
- `scaling` is the ring's score scale (Gemma's `query_pre_attn_scalar`), `position_ids`, `use_cache`,
  `output_router_logits` are not the attention's business;
- `sliding_window` W: HF's window lets a query see keys fewer than W positions back, so a window of at
  least the training sequence T is full causal attention, which the ring computes: accepted (Mistral's
  default 4096, Gemma2/3 windows wider than the run's model.seq_len); a narrower one is refused;
- refused in one line naming it (`--cp N: ...`): attention logit soft-capping (`softcap`, Gemma2), a
  window narrower than the sequence, attention sinks (`s_aux`, GPT-OSS), attention dropout > 0 while
  training, non-causal attention (the module's `is_causal` false), a mask of the family's own, and any
  other keyword with a value (the ring does not know what it means).

Before workers start (`check_context_attention`, from models/hf.py's launcher checks, and again, over 2·cp
tokens, on a meta-device model of the same class and config when the engine applies cp): the meta model
runs each decoder layer, alone (the layers before it replaced by stand-ins returning a meta activation, as a
pipeline stage does: hf_stages.py), up to its attention call, which applies the check and stops there, so
every refusal above is raised by the launcher; a layer that reaches no attention call through the interface
(a linear-attention or state-space layer: the ring would never see it) is refused too. Costs nothing: meta.

Positions: each cp rank holds a non-contiguous set of T/cp positions; the engine passes them as
`position_ids` through the `CausalLM` adapter, so RoPE and GPT-2's learned position embeddings see
the global positions. Packed documents (per-row positions [B, T] that restart at each document,
parallel/model/documents.py): the adapter and the pipeline stages also hand the shard's positions to
the attention call as `document_positions=` (models/hf_documents.py: only when this model runs the
ring), and the ring keeps
the documents apart (tiles kernel, the documents' keys travelling with K/V). Costs: those of ring
attention (parallel/model/context.py), per layer.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ndtrain.errors import UserError
from ndtrain.models.hf_documents import ATTENTION_NAME, DOCUMENTS
from ndtrain.models.hf_families import Family, family_of, hf_config, hf_model
from ndtrain.models.hf_stages import End, Incoming, StageEnd, model_parts, shell
from ndtrain.parallel.model.context import Ring, ring_attention

_RING = "_ndtrain_ring"
_NOT_ATTENTION = frozenset({"position_ids", "use_cache", "output_router_logits", "cache", "past_key_values",
                            "cache_position", "output_attentions"})
_NAMED = {"softcap": "attention logit soft-capping", "s_aux": "attention sinks"}


@dataclass(frozen=True)
class _Probe:
    """What the launcher's check stores instead of a ring: the cp degree; the call stops after the check."""

    cp: int


class _Checked(Exception):
    """A layer's attention call was checked (the launcher's probe stops the forward there)."""


def check_attention_call(module: nn.Module, cp: int, sequence: int, attention_mask: Any, kwargs: dict[str, Any]) -> None:
    """UserError (one line, `--cp N: ...`) for what this attention call asks that ring attention over a
    `sequence`-token sequence does not do (module docstring); `kwargs` are the call's keywords but `scaling`."""
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", type(module).__name__)
    start = f"--cp {cp}: context parallel is not supported for model_type {model_type!r}: its attention"
    for name, value in kwargs.items():
        if name in _NOT_ATTENTION or name in ("dropout", "sliding_window", "is_causal") or value is None or value is False:
            continue
        what = f"{_NAMED[name]} ({name})" if name in _NAMED else f"the keyword {name!r}"
        raise UserError(f"{start} takes {what}, which ring attention does not do: use cp=1")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise UserError(f"{start} is not causal (is_causal=False), and ring attention is: use cp=1")
    if attention_mask is not None:
        raise UserError(f"{start} applies a mask of its own, which ring attention does not: use cp=1")
    window = kwargs.get("sliding_window")
    if window is not None and window < sequence:
        raise UserError(f"{start} has a sliding window of {window} tokens (sliding_window), narrower than the "
                        f"{sequence}-token sequence, and ring attention is full causal: use model.seq_len <= {window} "
                        "or cp=1")
    dropout = kwargs.get("dropout") or 0.0
    if dropout > 0:
        raise UserError(f"{start} has dropout {dropout} while training, which ring attention does not apply: set "
                        "the model config's attention dropout (attention_dropout / attn_pdrop) to 0, or use cp=1")


def _ring_attention_forward(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any = None,
    scaling: float | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The AttentionInterface function: causal ring attention over the ring stored on `module` (the
    launcher's probe: the check alone)."""
    seat = getattr(module, _RING, None)
    if seat is None:
        raise UserError(f"context parallel: {type(module).__name__} calls the attention interface but is not the "
                        "attention module of a decoder layer, so it has no ring: use cp=1")
    cp = seat.cp if isinstance(seat, _Probe) else seat.group.size
    sequence = query.shape[2] * (1 if isinstance(seat, _Probe) else cp)
    documents = kwargs.pop(DOCUMENTS, None)
    check_attention_call(module, cp, sequence, attention_mask, kwargs)
    if isinstance(seat, _Probe):
        raise _Checked
    out = ring_attention(query, key, value, seat, scale=scaling, positions=documents)
    return out.transpose(1, 2).contiguous(), None


def _route(model: nn.Module, family: Family, seat: Ring | _Probe, cp: int) -> None:
    """Store `seat` on every decoder layer's attention and switch the model to the ring's implementation."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _ring_attention_forward)
    for layer in model.get_submodule(family.layers):
        setattr(layer.get_submodule(family.attention), _RING, seat)
    inner = hf_model(model)
    try:
        inner.set_attn_implementation(ATTENTION_NAME)  # type: ignore[union-attr]
    except (ValueError, ImportError) as e:
        raise UserError(f"--cp {cp}: context parallel is not supported for model_type {family.model_type!r}: "
                        f"transformers refuses it a custom attention function ({' '.join(str(e).split())[:120]}): use cp=1") from None


def _family(model: nn.Module, cp: int) -> Family:
    family = family_of(model)
    if family is None:
        raise UserError(f"--cp {cp}: context parallel is not supported for model_type {hf_config(model).model_type!r}: "
                        "its config declares no pipeline plan (base_model_pp_plan) naming its layers; use dp/ZeRO")
    return family


def _meta_copy(inner: Any) -> nn.Module | None:
    """A model of `inner`'s class and config on the meta device (transformers' warnings about the config
    silenced: the model was built already), or None when the class does not build there."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            return type(inner)(copy.deepcopy(inner.config))
    except Exception:  # noqa: BLE001 - the class will not build on the meta device: the calls check themselves
        return None
    finally:
        logging.set_verbosity(verbosity)


def apply_hf_context_parallel(model: nn.Module, ring: Ring) -> nn.Module:
    """Route every decoder-layer attention of the HF `model` (or its `CausalLM` adapter) through ring attention,
    after checking on a meta-device model of its class and config that every layer's attention call can take
    the ring (`check_context_attention` over 2·cp tokens: a window narrower than the training sequence is
    refused by the first forward instead, the launcher's check knowing the sequence)."""
    cp = ring.group.size
    family = _family(model, cp)
    meta = _meta_copy(hf_model(model))
    if meta is not None:
        check_context_attention(meta, cp, 2 * cp)
    _route(model, family, ring, cp)
    return model


def check_context_attention(model: nn.Module, cp: int, seq_len: int) -> None:
    """Refuse (one line) what ring attention cannot do for the meta-device `model` (or adapter) trained on
    `seq_len`-token sequences over `cp` ranks: each layer's attention call checked in training mode."""
    family = _family(model, cp)
    inner = hf_model(model)
    assert inner is not None
    implementation, training = inner.config._attn_implementation, inner.training
    _, base_path, list_name = model_parts(family)
    base = model.get_submodule(base_path)
    layers = list(model.get_submodule(family.layers))
    embedding = model.get_submodule(family.embeddings[0]).weight
    hidden = torch.zeros(1, seq_len, embedding.shape[-1], device="meta", dtype=embedding.dtype)
    tokens = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    positions = torch.arange(seq_len, device="meta").unsqueeze(0)
    _route(model, family, _Probe(cp), cp)
    inner.train()
    try:
        for index, layer in enumerate(layers):
            stand_ins = [Incoming(hidden)] * index + [layer] + [End(family.layer_input)] * (len(layers) - index - 1)
            probe = shell(base, {**base._modules, list_name: nn.ModuleList(stand_ins)}, True)
            try:
                probe(input_ids=tokens, position_ids=positions, use_cache=False)
                failure = "its forward went past it"
            except _Checked:
                continue
            except UserError:
                raise
            except StageEnd:
                failure = "the layer ended without one"
            except Exception as e:  # noqa: BLE001 - any failure on the meta device means it could not be checked
                failure = f"the meta-device forward failed first ({type(e).__name__}: {' '.join(str(e).split())[:100]})"
            raise UserError(f"--cp {cp}: context parallel is not supported for model_type {family.model_type!r}: decoder "
                            f"layer {index} makes no attention call through transformers' attention interface for the "
                            f"ring to replace ({failure}): use cp=1")
    finally:
        for layer in layers:
            delattr(layer.get_submodule(family.attention), _RING)
        inner.set_attn_implementation(implementation)  # type: ignore[union-attr]
        inner.train(training)
