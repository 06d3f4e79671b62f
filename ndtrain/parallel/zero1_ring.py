"""ZeRO-1's view of a bucket's flat layout over tensors that stay separate, for its shared-memory ring.

On one CPU host ZeRO-1 keeps neither a flat gradient nor a flat parameter buffer: the gradients
are the parameters' own `.grad`s and the parameters keep their own storage (zero1_gradients.py,
zero1_optimizer.py). The ring's collectives (host_stream.py) move elements of the bucket's
`FlatLayout` coordinates, so they reach those tensors through a reader and a writer:
`read_flat` copies a flat range out of the tensors (zeros where a tensor is missing, and in the
padding), `write_flat` copies one into them (the padding is dropped): the reader and writer of
the ring's `all_gather_through` (ZeroOptimizer's gather, straight into the parameters) and the
reader of its `reduce_scatter_mean` (the gradients), so the parameters need no flat copy.
Nothing here allocates beyond the ring's segments; the cost of a call is one pass over the range.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

import torch



def _overlaps(offsets: Sequence[int], numels: Sequence[int], start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(tensor index, lo, hi): the flat ranges [lo, hi) of the tensors overlapping [start, end), in order."""
    for i in range(max(0, bisect.bisect_right(offsets, start) - 1), len(offsets)):
        if offsets[i] >= end:
            return
        lo, hi = max(start, offsets[i]), min(end, offsets[i] + numels[i])
        if lo < hi:
            yield i, lo, hi


def read_flat(tensors: Sequence[torch.Tensor | None], offsets: Sequence[int], offset: int, into: torch.Tensor) -> None:
    """Elements [offset, offset + len(into)) of the tensors laid end to end from `offsets` into `into`
    (zero for a None tensor, and where no tensor lies: the padding)."""
    end = offset + into.numel()
    covered = offset
    numels = [0 if t is None else t.numel() for t in tensors]
    for i, lo, hi in _overlaps(offsets, numels, offset, end):
        if covered < lo:
            into[covered - offset : lo - offset].zero_()
        into[lo - offset : hi - offset].copy_(tensors[i].reshape(-1)[lo - offsets[i] : hi - offsets[i]])  # type: ignore[union-attr]
        covered = hi
    if covered < end:
        into[covered - offset :].zero_()


def write_flat(tensors: Sequence[torch.Tensor], offsets: Sequence[int], offset: int, values: torch.Tensor) -> None:
    """`values` into elements [offset, offset + len(values)) of the tensors laid end to end from
    `offsets` (each must be contiguous: written through its flat view); padding is dropped."""
    numels = [t.numel() for t in tensors]
    for i, lo, hi in _overlaps(offsets, numels, offset, offset + values.numel()):
        tensors[i].view(-1)[lo - offsets[i] : hi - offsets[i]].copy_(values[lo - offset : hi - offset])
