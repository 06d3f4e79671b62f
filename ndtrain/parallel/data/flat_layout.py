"""The padded flat layout of ZeRO-1/2/3: parameters end to end in one buffer, split evenly over N ranks.

The parameters given (Ψ elements, in that order) are laid out contiguously: parameter i holds
[offsets[i], offsets[i] + numel_i) of the flat buffer, in row-major order of its local shape. The
buffer is zero-padded at the end to Ψ' = s·N elements, s = ⌈Ψ/N⌉, so it splits into N equal
ranges: rank r owns [lo, hi) = [r·s, (r+1)·s), of which `real` elements are parameters (the
Ψ' − Ψ < N padding elements sit in the last ranks' ranges). With N = 1 it is a plain unpadded
concatenation (DDP's gradient buckets).

A layout allocates nothing: the strategies own the flat tensors (parameter values, gradients, fp32
masters, staging buffers) and ask the layout where each parameter sits (`views`), which pieces
of parameters fall in this rank's range (`segments`) and where the optimizer's tensors are cut
(`runs`; ZeRO's optimizers cut them also every `OPTIMIZER_RUN` elements: an elementwise optimizer
makes temporaries of a tensor's size, torch's CPU AdamW two at once, and with runs of half a 25 MB
bucket those 2 × 12.5 MB blocks stayed in glibc's heap after the step, ~20 MB more peak resident
memory per rank in `ndtrain bench zero1` than with 4 MB runs; the update itself is the same). Users: ZeRO-1's `_Shard` (zero1_optimizer.py), the gradient buckets of DDP and ZeRO-2
(buckets.py) and ZeRO-3's `FlatUnit` (zero3_unit.py).

Each parameter's `Placement` (parallel/placement.py: unsharded name and shape, tp slice, pipeline
duplicate) is read once, at construction, and handed out with its segments, so the gradient norm
and layout-agnostic checkpoints can map a flat shard back to parameter names and slices after the
flattening has replaced the parameters' storage. Nothing here communicates; a layout costs
O(number of parameters) host memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ndtrain.parallel.placement import Placement, placement_or_whole

OPTIMIZER_RUN = 1 << 20  # elements: the longest tensor ZeRO hands its (elementwise) optimizer


@dataclass(frozen=True)
class Segment:
    """The elements of one parameter that fall into a rank's range of a flat layout.

    `index`: the parameter's position in the layout; `placement`: its record, as read when the
    layout was built; `local_shape`: its shape on this rank (a tp slice's shape, say); elements
    [`start`, `stop`) of it, row-major, are `flat_view` (1-D), which starts at position `offset`
    of the rank's range."""

    index: int
    placement: Placement
    local_shape: tuple[int, ...]
    start: int
    stop: int
    offset: int
    flat_view: torch.Tensor


class FlatLayout:
    """`params` end to end, padded to a multiple of `ranks`; `rank`'s range is [lo, hi)."""

    def __init__(self, params: Sequence[torch.Tensor], ranks: int, rank: int) -> None:
        self.params = list(params)
        self.placements = [placement_or_whole(p) for p in self.params]  # a bare model's are whole
        self.shapes = [tuple(p.shape) for p in self.params]
        self.offsets: list[int] = []
        offset = 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset  # Ψ: real elements
        self.size = -(-offset // ranks)  # s: elements of each rank's range
        self.padded = self.size * ranks  # Ψ'
        self.lo = rank * self.size
        self.hi = self.lo + self.size

    @property
    def real(self) -> int:
        """Elements of this rank's range that are parameters (the rest is padding)."""
        return max(0, min(self.size, self.numel - self.lo))

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's elements of `flat` (a whole buffer of this layout), shaped like the parameter."""
        return [flat[a : a + p.numel()].view(p.shape) for p, a in zip(self.params, self.offsets)]

    def placed_ranges(self) -> list[tuple[int, int, Placement]]:
        """[start, stop) in flat coordinates and placement of every parameter of the layout."""
        return [(a, a + p.numel(), placement) for p, a, placement in zip(self.params, self.offsets, self.placements)]

    def pieces(self) -> list[tuple[int, int, int]]:
        """(parameter index, start, stop) in flat coordinates of each parameter's elements in [lo, hi)."""
        out = []
        for i, (p, a) in enumerate(zip(self.params, self.offsets)):
            lo, hi = max(a, self.lo), min(a + p.numel(), self.hi)
            if lo < hi:
                out.append((i, lo, hi))
        return out

    def segments(self, shard: torch.Tensor) -> list[Segment]:
        """The pieces of parameters in this rank's range, in flat order, with views of `shard`: this
        rank's range of any tensor laid out like this (values, gradient, master, optimizer state;
        its first `real` elements are enough)."""
        return [
            Segment(i, self.placements[i], self.shapes[i], lo - self.offsets[i], hi - self.offsets[i], lo - self.lo,
                    shard[lo - self.lo : hi - self.lo])
            for i, lo, hi in self.pieces()
        ]

    def runs(self, group_of: Sequence[int], max_len: int | None = None) -> list[tuple[int, int, int]]:
        """(start, stop, group) in flat coordinates: this rank's real elements cut where the group
        (`group_of[i]` for parameter i) changes, what one optimizer tensor covers; with `max_len`,
        also cut every `max_len` elements (bounding the temporaries an optimizer makes per tensor)."""
        out: list[tuple[int, int, int]] = []
        for i, lo, hi in self.pieces():
            if out and out[-1][2] == group_of[i] and out[-1][1] == lo:
                out[-1] = (out[-1][0], hi, group_of[i])
            else:
                out.append((lo, hi, group_of[i]))
        if max_len is None:
            return out
        return [(a, min(a + max_len, b), g) for start, b, g in out for a in range(start, b, max_len)]
