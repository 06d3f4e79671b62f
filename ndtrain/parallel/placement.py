"""Where each parameter a rank holds sits in the unsharded model: one frozen record per parameter.

Model parallelism changes what a rank's parameter is: tensor parallel keeps a slice of it
(`tp`: dim, start, length, padded full size), the pipeline cut keeps one stage and marks the head's
copy of a tied embedding as a duplicate. Those facts decide how much a parameter's Σg² counts in
the global gradient norm and where its values go in a checkpoint of the unsharded model, so they
live in one record, `Placement`, attached to the parameter by whoever changes its placement
(`place`, `carry_placement`) and read with `placement_of`. Data-parallel strategies that flatten
parameters into buffers read the record at construction and keep it with each segment, so it
survives the flattening. Nothing here communicates.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

_ATTRIBUTE = "_ndtrain_placement"


@dataclass(frozen=True)
class Shard:
    """Where a tp-sharded parameter sits in the full one: `length` indices from `start` along `dim`
    of a full tensor of `full` indices (padding beyond the real size included)."""

    dim: int
    start: int
    length: int
    full: int


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


def placement_of(param: torch.Tensor) -> Placement:
    """The parameter's record (a whole, unnamed parameter when nothing placed it)."""
    return getattr(param, _ATTRIBUTE, None) or Placement()


def place(param: nn.Parameter, **changes: Any) -> nn.Parameter:
    """Set fields of `param`'s record (the rest kept); returns `param`."""
    setattr(param, _ATTRIBUTE, dataclasses.replace(placement_of(param), **changes))
    return param


def carry_placement(new: nn.Parameter, old: torch.Tensor, **changes: Any) -> nn.Parameter:
    """`new` (e.g. a tp slice built from `old`) takes `old`'s record with `changes`; returns `new`."""
    setattr(new, _ATTRIBUTE, dataclasses.replace(placement_of(old), **changes))
    return new


def name_parameters(model: nn.Module) -> None:
    """Record every parameter's name and shape in the whole model (a tied parameter keeps its first name)."""
    for name, param in model.named_parameters():
        place(param, name=name, shape=tuple(param.shape))


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """True for parameters split over tp (their squared norms add up over the tp group)."""
    return placement_of(param).tp is not None
