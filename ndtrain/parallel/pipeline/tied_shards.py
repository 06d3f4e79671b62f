"""The two pipeline copies of a tied embedding/head when their gradients are sharded (ZeRO-2/3).

Under pp the first stage holds the embedding's copy of a tied weight W (V·d elements, a tp slice
under tp) and the last stage the head's; each copy's gradient must become the sum of both so the
copies take identical optimizer steps. With replicated gradients (zero 0/1) the runner swaps the
whole `.grad`s between the two stages. With ZeRO-2 (`Zero2DataParallel`) or ZeRO-3
(`FullyShardedDataParallel`) every micro-batch's gradient is reduce-scattered over dp×cp into flat
shards as backward runs, so at the end of the schedule dp rank r of each end stage holds the mean
gradient of its own copy on some range of W's elements, and the two stages' ranges differ (W sits
at different offsets of their flat layouts). `TiedShards` sums them after the schedule:

1. each rank writes its pieces of W's gradient into a zero V·d buffer and all-reduces it over
   dp×cp: every rank of the stage now holds its copy's whole (dp-mean) gradient;
2. the first and last stage swap these buffers over the pp group (the same pair as zero 0/1);
3. each rank adds the other copy's elements of its own ranges into its shard pieces.

Both copies' shards then hold the summed gradient, whatever each stage's flat layout. The gradient
norm counts W once (the head's copy has `pipeline_duplicate` placement weight 0).

Cost per step, on the two end stages only, N = |dp×cp|, b = gradient itemsize (fp32/float64):
all-reduce 2(N−1)/N·V·d·b + swap V·d·b each way; memory 2·V·d·b transiently (the dense gradient
zero 0/1 keeps for the whole step). Nothing else communicates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ndtrain.dist.comm import Group
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.placement import placement_of
from ndtrain.parallel.precision import master_dtype


@dataclass(frozen=True)
class TiedShards:
    """This rank's pieces of its copy's sharded gradient of the tied weight: `pieces[i]` holds
    elements `ranges[i]` = [start, stop) of the flattened (tp-local) weight of `numel` elements."""

    pieces: list[torch.Tensor]
    ranges: list[tuple[int, int]]
    numel: int
    dtype: torch.dtype
    device: torch.device

    def sum_with(self, peer: int, ctx: ParallelContext, pp_group: Group) -> None:
        """Add the other end stage's copy's gradient into the pieces (collective over dp×cp, then a
        swap with pp group rank `peer`)."""
        mine = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        for piece, (a, b) in zip(self.pieces, self.ranges):
            mine[a:b].copy_(piece)
        ctx.comm.all_reduce(mine, ctx.group("dp_cp"))
        other = torch.empty_like(mine)
        ctx.comm.batch_send_recv([(mine, peer)], [(other, peer)], pp_group).wait()
        with torch.no_grad():
            for piece, (a, b) in zip(self.pieces, self.ranges):
                piece.add_(other[a:b])


def tied_shards(stages: Sequence[nn.Module], tied: nn.Parameter) -> TiedShards:
    """The pieces of `tied`'s gradient in the shards of `stages` (wrappers with `grad_segments()`),
    found by the unsharded name of its placement (both copies carry the embedding's name)."""
    name = placement_of(tied).name
    segments = [s for stage in stages for s in stage.grad_segments() if s.placement.name == name]
    dtype = segments[0].flat_view.dtype if segments else master_dtype(tied.dtype)
    return TiedShards([s.flat_view for s in segments], [(s.start, s.stop) for s in segments],
                      tied.numel(), dtype, tied.device)
