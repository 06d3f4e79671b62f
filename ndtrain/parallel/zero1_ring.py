"""ZeRO-1's view of a bucket's flat layout over tensors that stay separate, for its shared-memory ring.

On one CPU host ZeRO-1 keeps neither a flat gradient nor a flat parameter buffer: the gradients
are the parameters' own `.grad`s and the parameters keep their own storage (zero1_gradients.py,
zero1_optimizer.py). The ring's collectives (host_stream.py) move elements of the bucket's
`FlatLayout` coordinates, so they reach those tensors through a reader and a writer:
`read_flat` copies a flat range out of the tensors (zeros where a tensor is missing, and in the
padding), `write_flat` copies one into them (the padding is dropped). `all_gather_through` is the
ring's all-gather (`SlotRing.all_gather`'s rounds, protocol and counted bytes) reading this
rank's range and writing the other ranks' through them, so the parameters need no flat copy.
Nothing here allocates beyond the ring's segments; the cost of a call is one pass over the range.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence

import torch

from ndtrain.host_slots import HostSlots
from ndtrain.host_stream import Reader, SlotRing, _Stream

Writer = Callable[[int, torch.Tensor], None]  # write(offset, values): values into flat range [offset, offset + len(values))


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


class _GatherThrough(_Stream):
    """`SlotRing.all_gather`'s rounds over a buffer reached through `read` and `write`."""

    op = "all_gather"

    def __init__(self, ring: SlotRing, size: int, read: Reader, write: Writer) -> None:
        super().__init__(ring, size)
        self.read, self.write = read, write

    def copy_in(self, cut: HostSlots, start: int, length: int) -> None:
        r = self.ring.rank
        self.read(r * self.size + start, cut.mine[r * length : (r + 1) * length])

    def own_part(self, cut: HostSlots, start: int, length: int) -> None:
        for k in range(self.ring.n):
            if k != self.ring.rank:
                self.write(k * self.size + start, cut.slots[k, k * length : (k + 1) * length])


def all_gather_through(ring: SlotRing, read: Reader, write: Writer, size: int) -> _Stream:
    """Every rank's range (of `size` elements) of a flat buffer, read on its owner with `read(offset,
    into)`, written on every other rank with `write(offset, values)`: (N−1)/N·N·size elements read
    between the processes, counted as `all_gather_shm`, as `ring.all_gather(flat, size)`."""
    return ring._start(_GatherThrough(ring, size, read, write))
