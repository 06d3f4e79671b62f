"""Where each parameter a rank holds sits in the unsharded model: one frozen record per parameter.

Model parallelism changes what a rank's parameter is: tensor parallel keeps a slice of it
(`tp`: dim, start, length, padded full size), the pipeline cut keeps one stage and marks the head's
copy of a tied embedding as a duplicate. Those facts decide how much a parameter's Σg² counts in
the global gradient norm and where its values go in a checkpoint of the unsharded model, so they
live in one record, `Placement`, attached to the parameter by whoever changes its placement
(`place`, `carry_placement`) and read with `placement_of`. Data-parallel strategies that flatten
parameters into buffers read the record at construction and keep it with each segment, so it
survives the flattening. Nothing here communicates.

The rule: every parameter of a prepared model is placed. The `Engine` names the whole model
(`name_parameters`), the model-parallel transforms carry the record to every parameter they make,
and `prepare_model` ends with `check_placed`, which names the first parameters without one.
`placement_of` refuses a parameter nothing placed; `placement_or_whole` is the explicit reading for
code that also takes a bare model (a strategy or tensor parallel used without the `Engine`), where
an unplaced parameter is whole and unnamed. A parameter is placed once: a second `place` raises
unless it says `replace=True`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

_ATTRIBUTE = "_ndtrain_placement"
_NAMED_IN_ERROR = 3  # unplaced parameters `check_placed` names before counting the rest


class PlacementError(RuntimeError):
    """A parameter without a `Placement` where one is required, or a second placement by accident."""


@dataclass(frozen=True)
class Shard:
    """Where a tp-sharded parameter sits in the full one: `length` indices from `start` along `dim`
    of a full tensor of `full` indices (padding beyond the real size included). With `blocks` > 1
    the dim is that many equal blocks of full/blocks indices (a packed gate|up or fused q|k|v
    projection) and this rank holds [start, start + length/blocks) of each, in block order."""

    dim: int
    start: int
    length: int
    full: int
    blocks: int = 1


@dataclass(frozen=True)
class Placement:
    """One parameter as this rank holds it. `name` / `shape`: the unsharded model's parameter name and
    shape (None until `name_parameters` ran on the whole model); `tp`: its slice over tp (None when
    replicated over tp); `pipeline_duplicate`: the head's copy of a pipeline-tied weight, counted
    once through the embedding's copy."""

    name: str | None = None
    shape: tuple[int, ...] | None = None
    tp: Shard | None = None
    pipeline_duplicate: bool = False

    def norm_weight(self, tp_size: int) -> float:
        """The share of this rank's Σg² of the parameter in a norm summed over the pp × tp group:
        1 for a tp shard, 1/tp for a parameter replicated over tp (every tp rank holds the same
        gradient), 0 for a pipeline duplicate."""
        if self.pipeline_duplicate:
            return 0.0
        return 1.0 if self.tp is not None else 1.0 / tp_size


def is_placed(param: torch.Tensor) -> bool:
    """Whether something placed `param` (it carries a `Placement`)."""
    return getattr(param, _ATTRIBUTE, None) is not None


def placement_of(param: torch.Tensor, name: str | None = None) -> Placement:
    """The parameter's record; `PlacementError` for a parameter nothing placed (`name`: how the caller
    knows it, for the message)."""
    placement = getattr(param, _ATTRIBUTE, None)
    if placement is None:
        what = repr(name) if name is not None else f"of shape {tuple(param.shape)} ({param.dtype})"
        raise PlacementError(f"parameter {what} has no Placement: the Engine names the whole model "
                             "(name_parameters) and every transform carries the record (carry_placement)")
    return placement


def placement_or_whole(param: torch.Tensor) -> Placement:
    """The parameter's record, or a whole, unnamed one when nothing placed it: for code that also takes
    a bare model (a strategy or tensor parallel used without the `Engine`), never for code that needs
    the unsharded name."""
    return getattr(param, _ATTRIBUTE, None) or Placement()


def place(param: nn.Parameter, *, replace: bool = False, **changes: Any) -> nn.Parameter:
    """Set fields of `param`'s record (the rest kept; a whole, unnamed record if it had none); returns
    `param`. A placed parameter is re-placed only with `replace=True`: otherwise `PlacementError`."""
    if is_placed(param) and not replace:
        raise PlacementError(f"parameter {placement_of(param).name or tuple(param.shape)!r} is already placed "
                             f"({placement_of(param)}): re-place it explicitly with place(..., replace=True)")
    setattr(param, _ATTRIBUTE, dataclasses.replace(placement_or_whole(param), **changes))
    return param


def carry_placement(new: nn.Parameter, old: torch.Tensor, **changes: Any) -> nn.Parameter:
    """`new` (e.g. a tp slice built from `old`, unplaced) takes `old`'s record (whole if `old` has none:
    tensor parallel on a bare model) with `changes`, and its `requires_grad` (a frozen parameter's
    slice stays frozen); returns `new`."""
    if is_placed(new):
        raise PlacementError(f"carry_placement: the new parameter of shape {tuple(new.shape)} is already placed "
                             f"({placement_of(new)})")
    setattr(new, _ATTRIBUTE, dataclasses.replace(placement_or_whole(old), **changes))
    return new.requires_grad_(old.requires_grad)


def name_parameters(model: nn.Module) -> None:
    """Record every parameter's name and shape in the whole model (a tied parameter keeps its first
    name). Explicitly a re-placement: a model handed to a second `Engine` is named again."""
    for name, param in model.named_parameters():
        place(param, name=name, shape=tuple(param.shape), replace=True)


def check_placed(model: nn.Module) -> None:
    """Every parameter of `model` carries a `Placement`; `PlacementError` naming the first ones that do not
    (as nanotron's `sanity_check`)."""
    unplaced = [name for name, param in model.named_parameters() if not is_placed(param)]
    if unplaced:
        named = ", ".join(repr(n) for n in unplaced[:_NAMED_IN_ERROR])
        more = f" and {len(unplaced) - _NAMED_IN_ERROR} more" if len(unplaced) > _NAMED_IN_ERROR else ""
        raise PlacementError(f"after preparation, parameter(s) {named}{more} have no Placement: whatever made them "
                             "must carry the record of the parameter they replace (carry_placement)")


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """True for parameters split over tp (their squared norms add up over the tp group); a parameter
    nothing placed is not split (tensor parallel places every slice it makes)."""
    return placement_or_whole(param).tp is not None
