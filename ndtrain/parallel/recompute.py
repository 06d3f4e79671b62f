"""Activation recomputation: keep fewer activations for backward, recompute the rest in backward.

Modes, per block of the model's decoder-layer list (`hf_families.decoder_layers`: the built-in
Llama's `layers`, a Hugging Face family's layer list, or else the largest nn.ModuleList of
identical blocks), with torch.utils.checkpoint in its non-reentrant form, positional and keyword
arguments passed through (HF layers take `attention_mask=`, `position_embeddings=`, ... by keyword):
- `full`: each block's forward runs under checkpoint; only its inputs (the residual stream x and
  the shared RoPE tables) are kept, and the whole block runs again in backward (one extra
  forward of every block: ≈ +33% compute).
- `selective` (Megatron's selective recomputation, Korthikanti et al. 2022): only the attention
  core, the `Attention.attend(q, k, v)` seam, runs under checkpoint; q, k, v are kept (they are
  its inputs), its output and log-sum-exp are recomputed. The seam becomes a `SelectiveRecompute`
  whose `.inner` is the previous core, so `apply_context_parallel` before or after puts ring
  attention inside it. Recomputing ring attention runs its forward ring again in backward: c−1
  more K/V exchanges per layer (2·B·K·s·h elements each).
  A Hugging Face model has no `attend` seam (its core is chosen through transformers' attention
  registry): there `selective` checkpoints each layer's whole attention module (the family's
  `attention`: q/k/v projections, RoPE, core, output projection), keeping its input and
  recomputing the rest; the MLP's activations are kept. That saves more than Megatron's
  selective recompute and costs the attention projections' compute once more.

Bytes saved for backward per block (what `SavedActivations` measures; fp32, e = 4 bytes per
element; s = B·T tokens on this rank, d model dim, H/K query/kv heads, h head size, f FFN dim;
the tensors autograd keeps, counted once per storage):

    none       e·(9sd + 2sKh + sH + 2s + 4sf)      # `block_saved_bytes`
      norms    2 × (x, x·rstd, its product with the weight: 3sd; rstd: s)
      attention  q: sd, k and v: 2sKh, output: sd, log-sum-exp: sH, input of wo: sd
      ffn      input of w1/w3 is the norm's output (counted above); w1·x, silu(w1·x), w3·x,
               their product (input of w2): 4sf
    selective  none − e·(sd + sH)                   # the core's output and log-sum-exp
    full       e·sd                                 # the block input

plus, once for all blocks, the RoPE tables cos and sin (T·h/2 elements each: e·T·h bytes).
Korthikanti et al. count sbh(34 + 5as/h) bytes per GPT layer in fp16 with dropout, of which
selective recomputation drops the 5as²b of the attention core's scores, softmax and dropout mask,
and full keeps 2sbh. Our block has no dropout and a flash-style core that keeps O(s) (output and
log-sum-exp) instead of O(s²), so selective drops only e·(sd + sH) here; full keeps e·sd.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ndtrain.config import ModelConfig
from ndtrain.errors import UserError
from ndtrain.models.hf_families import decoder_layers, family_of
from ndtrain.options import RECOMPUTE_MODES as MODES


class SelectiveRecompute:
    """An `attend(q, k, v)` seam that recomputes its `inner` core in backward instead of saving it."""

    def __init__(self, inner: Callable[..., torch.Tensor]) -> None:
        self.inner = inner

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, q, k, v, use_reentrant=False)


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _recompute_forward(module: nn.Module) -> None:
    module.forward = functools.partial(_checkpointed, module.forward)


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
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
    family = family_of(model)
    for block in found[1]:
        if mode == "full":
            _recompute_forward(block)
        elif family is not None:
            _recompute_forward(block.get_submodule(family.attention))
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


def block_saved_bytes(cfg: ModelConfig, tokens: int, mode: str, element_size: int = 4) -> int:
    """Bytes one Llama block keeps for backward for `tokens` (= B·T local) tokens, RoPE tables excluded."""
    s, d, f = tokens, cfg.dim, cfg.ffn_dim
    heads, kv_heads, head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.dim // cfg.n_heads
    none = 9 * s * d + 2 * s * kv_heads * head_dim + s * heads + 2 * s + 4 * s * f
    elements = {"none": none, "selective": none - s * d - s * heads, "full": s * d}[mode]
    return element_size * elements


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
