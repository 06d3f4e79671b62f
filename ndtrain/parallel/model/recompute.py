"""Activation recomputation: keep fewer activations for backward, recompute the rest in backward.

Modes, per block of the model's decoder-layer list (`model_spec.decoder_layers`: the built-in
Llama's `layers`, a Hugging Face family's layer list, or else the largest nn.ModuleList of
identical blocks), with torch.utils.checkpoint in its non-reentrant form, positional and keyword
arguments passed through (HF layers take `attention_mask=`, `position_embeddings=`, ... by keyword):
- `full`: each block's forward runs under checkpoint; only its inputs (the residual stream x and
  the shared RoPE tables) are kept, and the whole block runs again in backward (one extra
  forward of every block: ≈ +33% compute).
- `selective` (Megatron's selective recomputation, Korthikanti et al. 2022): only the attention
  core, the `Attention.attend(q, k, v, documents)` seam, runs under checkpoint; q, k, v are kept (they are
  its inputs), its output and log-sum-exp are recomputed. The seam becomes a `SelectiveRecompute`
  whose `.inner` is the previous core, so `apply_context_parallel` before or after puts ring
  attention inside it. Recomputing ring attention runs its forward ring again in backward: c−1
  more K/V exchanges per layer (2·B·K·s·h elements each).
  A Hugging Face model has no `attend` seam (its core is chosen through transformers' attention
  registry): there `selective` checkpoints the unit its model spec names in each layer
  (`ModelParallel.selective_unit`; models/hf_parallel.py: the family's whole `attention` module,
  q/k/v projections, RoPE, core, output projection), keeping its input and
  recomputing the rest; the MLP's activations are kept. That saves more than Megatron's
  selective recompute and costs the attention projections' compute once more.

What each mode keeps per block of the built-in Llama, in bytes, is worked out with
`block_saved_bytes` in models/llama_parallel.py; `SavedActivations` measures it.

RNG: checkpoint's `preserve_rng_state` restores, before the recomputation, the CPU generator and
the generator of every device a tensor argument lives on, so dropout draws the same mask twice.
It looks at positional arguments only; keyword arguments (a Hugging Face attention gets
`hidden_states=` by keyword) are therefore handed to it as one positional dict, so a CUDA input is
seen and the CUDA generator is restored too (else a recomputed dropout would draw a new mask).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ndtrain.errors import UserError
from ndtrain.parallel.model.documents import Documents
from ndtrain.parallel.model_spec import decoder_layers, parallel_spec
from ndtrain.config.options import RECOMPUTE_MODES as MODES
from ndtrain.config.options import RecomputeMode


class SelectiveRecompute:
    """An `attend(q, k, v, documents)` seam that recomputes its `inner` core in backward instead of saving it."""

    def __init__(self, inner: Callable[..., torch.Tensor]) -> None:
        self.inner = inner

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None = None
                 ) -> torch.Tensor:
        return checkpoint(self.inner, q, k, v, documents, use_reentrant=False)


def _with_keywords(forward: Callable[..., Any], kwargs: dict[str, Any], *args: Any) -> Any:
    return forward(*args, **kwargs)


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`forward(*args, **kwargs)` under checkpoint, the keyword arguments passed positionally (module docstring: RNG)."""
    return checkpoint(functools.partial(_with_keywords, forward), kwargs, *args, use_reentrant=False)


def _recompute_forward(module: nn.Module) -> None:
    module.forward = functools.partial(_checkpointed, module.forward)


def apply_recompute(model: nn.Module, mode: RecomputeMode) -> nn.Module:
    """Recompute `model`'s blocks (its decoder-layer list) in backward per `mode`: "none" | "selective" | "full"."""
    if mode not in MODES:
        raise UserError(f"recompute mode {mode!r} is unknown: choose one of {', '.join(MODES)}")
    if mode == "none":
        return model
    found = decoder_layers(model)
    if found is None:
        raise UserError(
            f"recompute={mode!r} needs a list of blocks (an nn.ModuleList of one block class): "
            f"{type(model).__name__} has none"
        )
    spec = parallel_spec(model)
    for block in found[1]:
        unit = spec.selective_unit(block) if spec is not None and mode == "selective" else None
        if mode == "full":
            _recompute_forward(block)
        elif unit is not None:
            _recompute_forward(unit)
        else:
            attentions = [m for m in block.modules() if hasattr(m, "attend")]
            if not attentions:
                raise UserError(
                    f"recompute='selective' needs an attention with an `attend` seam in {type(block).__name__}: "
                    "use recompute='full'"
                )
            for attention in attentions:
                attention.attend = SelectiveRecompute(attention.attend)
    return model


class SavedActivations:
    """Context manager: bytes of the tensors autograd saves for backward while it is active.

    Each storage counts once, over the span its saved views cover; the storages of `exclude`
    (the parameters) are not activations and are left out. Deterministic, unlike a process's RSS."""

    def __init__(self, exclude: nn.Module | None = None) -> None:
        params = exclude.parameters() if exclude is not None else ()
        self._excluded = {p.untyped_storage().data_ptr() for p in params}
        self._spans: dict[int, tuple[int, int]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage().data_ptr()
        if key in self._excluded or tensor.numel() == 0:
            return tensor
        size = tensor.element_size()
        start = tensor.storage_offset() * size
        end = start + size * (1 + sum((n - 1) * abs(st) for n, st in zip(tensor.shape, tensor.stride())))
        low, high = self._spans.get(key, (start, end))
        self._spans[key] = (min(low, start), max(high, end))
        return tensor

    @property
    def bytes(self) -> int:
        return sum(high - low for low, high in self._spans.values())

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
