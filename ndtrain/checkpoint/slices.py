"""This rank's checkpoint slices, as the data-parallel strategy answers for them.

A checkpoint stores each parameter under the unsharded model's name (`Placement.name`) with its
global shape (`Placement.shape`), as the fp32 master when the model computes in bf16/fp16, and
the optimizer's state of it beside it (AdamW: exp_avg and exp_avg_sq of the same shape, step a
scalar). What a rank holds of a parameter is one or more `Run`s: a contiguous range of the
row-major flattened tp-local parameter (its tp slice, padding included), kept in `owner`, the
tensor the optimizer updates and keys its state by, from element `at` on. The strategy says which
ranges it holds (`DataParallelStrategy.held_slices()`, parallel/data/held_slices.py: whole
parameters when replicated, this rank's share of each flat bucket or unit under ZeRO); this module
never looks at its type or fields, only at the parameters' placements.

`boxes` turns a run into at most 2·ndim − 1 rectangular pieces of the global tensor (global
offsets, sizes, and a view of any owner-shaped tensor), cutting tp padding away; a packed tp dim
(`Shard.blocks`) cuts each piece once more per block it crosses. `Run.writes`
says whether this rank offers the run for writing: not the pipeline's duplicate of a tied weight,
not a tp-replicated parameter on tp ranks other than 0 (their flat layouts may differ); replicas
over dp/cp (zero 0, unsharded fp32 masters) all offer identical boxes and DCP's deduplication
keeps one of each, spreading the writes over the replicas.
`compute_copies` lists the module parameters that are not owners and must be refilled whole on
load (the strategy's `compute_copies()`: ZeRO-1/2's replicated buffers, in the compute dtype).
Nothing here communicates.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from ndtrain.parallel.placement import Placement, Shard, placement_of


@dataclass(frozen=True)
class Run:
    """Elements [start, end) of the flattened tp-local parameter `name`, held in `owner` from `at` on."""

    name: str
    shape: tuple[int, ...]          # global (unsharded) shape
    tp: Shard | None                # the parameter's tp slice (None: replicated over tp)
    local_shape: tuple[int, ...]    # the tp-local parameter's shape (padding included)
    start: int
    end: int
    owner: torch.Tensor
    at: int
    writes: bool


@dataclass(frozen=True)
class Box:
    """A rectangular piece of a run: where it sits in the global tensor and how to view it locally."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int                 # in the owner's flattened elements
    local_sizes: tuple[int, ...]    # the box in tp-local coordinates (before cutting padding)
    keep: tuple[int, int, int] | None  # (dim, start, length) to narrow to: the real part of a padded tp dim,
    #                                    or the part of the box in one block of a packed tp dim (Shard.blocks)

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """This box of `tensor` (shaped like the run's owner), as a view."""
        flat = tensor.reshape(-1)[self.flat_start : self.flat_start + math.prod(self.local_sizes)]
        out = flat.view(self.local_sizes)
        return out if self.keep is None else out.narrow(*self.keep)


def flat_boxes(start: int, end: int, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Rectangular (offsets, sizes) covering the row-major flat range [start, end) of `shape`, in order;
    each one contiguous in flat order (≤ 2·ndim − 1 boxes)."""
    if start >= end:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    rest = tuple(shape[1:])
    if start % inner == 0 and end % inner == 0:
        return [((start // inner, *([0] * len(rest))), (end // inner - start // inner, *rest))]
    first, last = start // inner, end // inner
    if first == last or (first + 1 == last and end % inner == 0):
        return [((first, *o), (1, *s)) for o, s in flat_boxes(start - first * inner, end - first * inner, rest)]
    out = []
    if start % inner:
        out += [((first, *o), (1, *s)) for o, s in flat_boxes(start % inner, inner, rest)]
        first += 1
    if first < last:
        out.append(((first, *([0] * len(rest))), (last - first, *rest)))
    if end % inner:
        out += [((last, *o), (1, *s)) for o, s in flat_boxes(0, end % inner, rest)]
    return out


def boxes(run: Run) -> list[Box]:
    """The run as global pieces; pieces lying wholly in tp padding are dropped."""
    strides = [math.prod(run.local_shape[i + 1 :]) for i in range(len(run.local_shape))]
    out = []
    for offsets, sizes in flat_boxes(run.start, run.end, run.local_shape):
        flat_start = run.at + sum(o * s for o, s in zip(offsets, strides)) - run.start
        if run.tp is None:
            out.append(Box(tuple(offsets), tuple(sizes), flat_start, tuple(sizes), None))
        else:
            out += _tp_boxes(run.tp, run.shape[run.tp.dim], offsets, sizes, flat_start)
    return out


def _tp_boxes(tp: Shard, real: int, offsets: tuple[int, ...], sizes: tuple[int, ...], flat_start: int) -> list[Box]:
    """A local box of a tp shard placed in the global tensor: cut where it crosses a block of a packed
    dim (`Shard.blocks`: each block's part lies elsewhere), narrowed to the real part of a padded dim."""
    d, per_block, block_size = tp.dim, tp.length // tp.blocks, tp.full // tp.blocks
    out = []
    lo, end = offsets[d], offsets[d] + sizes[d]
    while lo < end:
        block, within = divmod(lo, per_block)
        hi = min(end, (block + 1) * per_block)
        at = block * block_size + tp.start + within  # the global index of local index lo
        length = min(at + hi - lo, real) - at
        if length > 0:
            global_offsets, global_sizes = list(offsets), list(sizes)
            global_offsets[d], global_sizes[d] = at, length
            keep = None if length == sizes[d] else (d, lo - offsets[d], length)
            out.append(Box(tuple(global_offsets), tuple(global_sizes), flat_start, tuple(sizes), keep))
        lo = hi
    return out


def runs(engine: Any) -> list[Run]:
    """Every run this rank holds (see the module docstring), in the strategy's order."""
    tp_first = engine.ctx.coord("tp") == 0
    return [_run(h.param, h.start, h.end, h.owner, h.at, tp_first) for h in engine.dp.held_slices()]


def compute_copies(engine: Any) -> list[Run]:
    """Module parameters a load must fill whole besides the runs' owners (ZeRO-1/2's replicated
    buffers, in the compute dtype), each as one run held in the parameter itself."""
    return [_run(p, 0, p.numel(), p, 0, True) for p in engine.dp.compute_copies()]


def optimizer_state(engine: Any) -> MutableMapping[torch.Tensor, dict[str, Any]]:
    """The optimizer's per-owner state (keyed by the owner): AdamW's exp_avg, exp_avg_sq, step."""
    return engine.dp.optimizer_state()


def _run(param: torch.Tensor, start: int, end: int, owner: torch.Tensor, at: int, tp_first: bool) -> Run:
    placement: Placement = placement_of(param)
    if placement.name is None or placement.shape is None:
        raise RuntimeError("a parameter without a Placement name: Engine names the whole model's parameters")
    writes = not placement.pipeline_duplicate and (placement.tp is not None or tp_first)
    return Run(placement.name, placement.shape, placement.tp, tuple(param.shape), start, end, owner, at, writes)
