"""What a rank's optimizer holds of each parameter: the strategies' answer to the checkpoints.

A checkpoint (checkpoint/slices.py) stores every parameter under its unsharded name with its global
shape, and its optimizer state beside it; it asks the data-parallel strategy which pieces of which
parameters this rank holds (`DataParallelStrategy.held_slices()`), and never looks at the strategy's
type or fields. Each piece is a `HeldSlice`: a contiguous range of the row-major flattened (tp-local)
module parameter, kept in `owner`, the tensor the optimizer updates and keys its state by:

| strategy                                   | owner                                  | slices per rank                   |
|--------------------------------------------|----------------------------------------|-----------------------------------|
| replicated (DDP, fp32)                     | the module parameter itself            | every parameter, whole (`whole`)  |
| ZeRO-0 masters, ZeRO-1/2 (`ZeroOptimizer`) | a segment of a bucket's flat buffer, or of its fp32 master | this rank's share of each bucket (`flat_slices`) |
| ZeRO-3 (`FlatUnit`)                        | a segment of a unit's fp32 shard       | this rank's share of each unit (`flat_slices`) |

Nothing here communicates; a rank's slices cost O(number of parameters + segments) host memory.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ndtrain.parallel.data.flat_layout import FlatLayout


@dataclass(frozen=True)
class HeldSlice:
    """Elements [start, end) of the flattened (tp-local) module parameter `param` (whose `Placement`
    names it), kept in `owner` from element `at` on."""

    param: nn.Parameter
    start: int
    end: int
    owner: torch.Tensor
    at: int


def whole(params: Iterable[nn.Parameter]) -> list[HeldSlice]:
    """Each parameter whole, held in itself (a replicated strategy, or what a sharding one leaves out)."""
    return [HeldSlice(p, 0, p.numel(), p, 0) for p in params]


class WholeParameters:
    """The checkpoint answers of a strategy whose every rank holds each parameter of `module` whole and
    updates it with a plain `optimizer` over the module parameters (DDP in fp32, a replicated variant):
    every parameter held whole, no compute copies to refill, the optimizer's own state."""

    module: nn.Module
    optimizer: torch.optim.Optimizer

    def held_slices(self) -> list[HeldSlice]:
        return whole(self.module.parameters())

    def compute_copies(self) -> list[nn.Parameter]:
        return []

    def optimizer_state(self) -> MutableMapping[torch.Tensor, dict[str, Any]]:
        return self.optimizer.state


def flat_slices(layout: FlatLayout, owners: Iterable[tuple[int, int, torch.Tensor]]) -> list[HeldSlice]:
    """Each owner tensor holding flat elements [a, b) of `layout`, cut at parameter boundaries."""
    out = []
    for a, b, owner in owners:
        for p, offset in zip(layout.params, layout.offsets):
            lo, hi = max(a, offset), min(b, offset + p.numel())
            if lo < hi:
                out.append(HeldSlice(p, lo - offset, hi - offset, owner, lo - a))
    return out
