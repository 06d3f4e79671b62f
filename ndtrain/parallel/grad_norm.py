"""The global gradient norm and the clip formula, once for every layout.

The norm is the L2 norm of the whole model's gradient over the whole world, each parameter counted
exactly once. Every rank lists the pieces of gradient it holds (`GradPiece`: a whole `.grad`, or a
slice of a flat shard) with their weight in Σg², read from the parameter's `Placement.norm_weight`:
1 for a tp shard, 1/tp for a parameter replicated over tp (every tp rank holds the same gradient),
0 for a pipeline duplicate (left out). The weighted local Σg² is then summed over the ranks holding
distinct pieces: dp_cp when the pieces are shards of a gradient sharded over dp×cp (ZeRO), mp
(pp×tp) when there is model parallelism, the whole world when both: one 4-byte all-reduce (8 for
a float64 model), nothing when neither. `clip_coefficient` is `torch.nn.utils.clip_grad_norm_`'s
formula; `clip_` applies it in place.

Flat shards hold several parameters end to end: `segment_spans` cuts a segment of a flat layout
(`FlatLayout.placed_ranges`: where each parameter sits, with its placement) where the weight changes (adjacent parameters of equal weight stay one piece, so without model
parallelism a segment is one piece).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.placement import Placement, placement_or_whole
from ndtrain.parallel.precision import master_dtype

GradPiece = tuple[torch.Tensor, float]  # gradient elements this rank holds, their weight in Σg²
Span = tuple[int, int, float]  # [start, end) in a flat buffer (or segment), weight


def whole_pieces(params: Iterable[torch.Tensor], tp: int) -> list[GradPiece]:
    """Each parameter's whole `.grad` (parameters without one left out) with its placement's weight (a
    bare model's parameters, which nothing placed, are whole: `placement_or_whole`)."""
    pieces = []
    for p in params:
        weight = placement_or_whole(p).norm_weight(tp)
        if p.grad is not None and weight:
            pieces.append((p.grad.detach(), weight))
    return pieces


def segment_spans(start: int, end: int, layout: Sequence[tuple[int, int, Placement]], tp: int) -> list[Span]:
    """The elements [start, end) of a flat buffer with `layout` as spans relative to `start`, cut where
    the weight changes; padding and zero-weight parameters left out."""
    spans: list[Span] = []
    for a, b, placement in layout:
        lo, hi = max(a, start) - start, min(b, end) - start
        weight = placement.norm_weight(tp)
        if lo >= hi or not weight:
            continue
        if spans and spans[-1][1] == lo and spans[-1][2] == weight:
            spans[-1] = (spans[-1][0], hi, weight)
        else:
            spans.append((lo, hi, weight))
    return spans


def segment_pieces(grad: torch.Tensor, spans: Sequence[Span]) -> list[GradPiece]:
    """The pieces of a flat segment's gradient `grad` (1-D) given its `segment_spans`."""
    return [(grad[a:b], weight) for a, b, weight in spans]


def flat_pieces(grads: Iterable[torch.Tensor], spans: Iterable[Sequence[Span]]) -> list[GradPiece]:
    """The pieces of several flat segments' gradients, each with its `segment_spans` (which depend on
    the layout only: strategies compute them once and reuse them every step)."""
    return [piece for grad, s in zip(grads, spans) for piece in segment_pieces(grad, s)]


def local_squares(pieces: Sequence[GradPiece], device: torch.device) -> torch.Tensor:
    """Σ weight·Σg² over `pieces` (fp32, or float64 for float64 gradients); no communication."""
    if not pieces:
        return torch.zeros((), device=device)
    return torch.stack([weight * _squares(g) if weight != 1.0 else _squares(g) for g, weight in pieces]).sum()


def _squares(g: torch.Tensor) -> torch.Tensor:
    """Σg² in one read of `g`: its 2-norm squared, accumulated in fp32 (float64 for float64), with no
    g² temporary (`g.pow(2).sum()` writes and reads one: a tenth of the speed on one CPU thread)."""
    return torch.linalg.vector_norm(g, dtype=master_dtype(g.dtype)).square()


def global_grad_norm(pieces: Sequence[GradPiece], ctx: ParallelContext, *, sharded: bool) -> torch.Tensor:
    """The world's gradient norm (identical on every rank) from this rank's `pieces`; `sharded`: they
    are this rank's share of a gradient sharded over dp_cp. Collective over the groups named above."""
    squares = local_squares(pieces, ctx.device)
    group = norm_group(ctx, sharded=sharded)
    if group is not None:
        ctx.comm.all_reduce(squares, ctx.group(group))
    return squares.sqrt()


def norm_group(ctx: ParallelContext, *, sharded: bool) -> str | None:
    """The group whose ranks hold distinct pieces of the gradient: dp_cp (sharded), mp, world (both), or none."""
    model_parallel = ctx.group("mp").size > 1
    if sharded:
        return "world" if model_parallel else "dp_cp"
    return "mp" if model_parallel else None


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_`'s factor: max_norm / (norm + 1e-6), at most 1."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def clip_(grads: Sequence[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale `grads` in place by `clip_coefficient(norm, max_norm)`."""
    if grads:
        torch._foreach_mul_(list(grads), clip_coefficient(norm, max_norm))


def optimizer_param_grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The `.grad`s of a plain optimizer's parameters (those that have one), what its step reads."""
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
