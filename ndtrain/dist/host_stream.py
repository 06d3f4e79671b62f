"""Bucket-sized collectives streamed through a small ring of shared-memory segments (one CPU host).

Users: ZeRO-1's gradient buckets and parameter gathers (below), and ZeRO-3's unit gathers and
gradient reduce-scatters (zero3_unit.py: the unit's flat `full` and `grad_full` buffers are laid
out as N ranges of s, as here).

ZeRO-1's gradient buckets on one host (zero1_gradients.py, `HostShardReduceBucket`) are private
memory that exists only from the first gradient of a backward to `zero_grad(set_to_none=True)`,
so the forward pass, where activations peak, holds no gradient (a bucket that lived in shared
memory, dist/host_slots.py, would be resident all the time and, in every rank's resident set, the
(N−1)/N of the other slots it reads too). The ranks still reduce through shared memory, not
gloo's sockets: a `SlotRing` is `depth` HostSlots segments of N slots of N·p elements (p =
`PIECE`), and a collective over a flat buffer of N ranges of s elements (rank r's range is
[r·s, (r+1)·s), `FlatLayout`'s cut) runs as ⌈s/p⌉ rounds, round j covering elements
[j·p, j·p + L) of every range (L = min(p, s − j·p)), each on the ring's next segment, cut to N
parts of L (`HostSlots.cut`):

- `reduce_scatter_mean(read, out, s)`: the buffer is the caller's, read through `read(offset,
  into)` (ZeRO-1: the parameters' own `.grad`s, laid out by the bucket's `FlatLayout`). This rank
  copies the other ranks' pieces of it into its slot (part k for rank k); once every rank has, it
  reads its own piece into `out` (this range's s elements), adds part r of every other slot, in
  slot order, and divides by N: `out` is the mean over the ranks. (N−1)/N·N·L read per round:
  (N−1)/N·N·s in all, counted as `reduce_scatter_shm`; the copy-in is one extra pass over
  (N−1)/N of the buffer.
- `all_gather(flat, s)`: this rank copies its piece into part r of its slot; once every rank has,
  it copies part k of slot k into its buffer for every k ≠ r: (N−1)/N·N·s read in all, counted as
  `all_gather_shm`.

Rounds run in the order collectives were started (one queue per ring; every rank starts the same
collectives in the same order), at most `depth` in flight: a segment is reused only after the
round that last used it completed on this rank, which the slots' protocol allows only once every
rank is done with it. A collective is asynchronous: `done()` advances the ring without blocking,
`wait()` blocks on the oldest round in flight (a watched collective, so a stalled peer is named by
the watchdog) until its own rounds are complete.

Memory per rank: depth·N·p elements of shared pages (p = 2^18: 4 MB in fp32 at N = 2, both
segments), plus the (N−1)·depth·p of the other slots it reads, counted in its resident set.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from ndtrain.dist.comm import Communicator, Group, Pending
from ndtrain.dist.host_slots import HostSlots

Reader = Callable[[int, torch.Tensor], None]  # read(offset, into): a flat range of the caller's buffer into `into`

PIECE = 1 << 18  # elements of each rank's range moved per round
DEPTH = 2  # segments in the ring: rounds in flight


class SlotRing:
    """`depth` shared-memory segments of N slots of N·`piece` elements, taken in turn by the rounds of
    the collectives started on it."""

    def __init__(self, segments: list[HostSlots], piece: int) -> None:
        self.segments, self.piece, self.dtype = segments, piece, segments[0].dtype
        group = segments[0].group
        self.n, self.rank = group.size, group.rank
        self._queue: deque[_Stream] = deque()  # collectives with rounds not launched yet, oldest first
        self._in_flight: deque[tuple[_Stream, Pending]] = deque()  # launched rounds, oldest first
        self._turn = 0

    @staticmethod
    def open(comm: Communicator, group: Group, dtype: torch.dtype, *, piece: int = PIECE,
             depth: int = DEPTH) -> SlotRing | None:
        """Collective over `group` (CPU): the ring, or None on every rank where some rank cannot map a
        segment (`HostSlots.open` decides that alike on every rank)."""
        segments = []
        for _ in range(depth):
            segment = HostSlots.open(comm, group, group.size * piece, dtype, chunk=piece)
            if segment is None:
                return None
            segments.append(segment)
        return SlotRing(segments, piece)

    def reduce_scatter_mean(self, read: Reader, out: torch.Tensor, size: int) -> _Stream:
        """`out` ([size]) becomes the mean over the ranks of range r (= this rank) of their flat buffers of
        N·size elements, which `read(offset, into)` copies from (elements [offset, offset + len(into)))."""
        return self._start(_ReduceScatterRounds(self, read, out, size))

    def all_gather(self, flat: torch.Tensor, size: int) -> _Stream:
        """Every rank's range of `flat` ([N·size]) into every rank's `flat`."""
        return self._start(_GatherRounds(self, size, flat))

    def _start(self, stream: _Stream) -> _Stream:
        self._queue.append(stream)
        self.advance()
        return stream

    def advance(self) -> None:
        """Complete the rounds in flight that are done (oldest first) and launch the next ones."""
        while self._in_flight and self._in_flight[0][1].done():
            stream, pending = self._in_flight.popleft()
            pending.wait()  # settles it: already complete
            stream.completed += 1
        while self._queue and len(self._in_flight) < len(self.segments):
            stream = self._queue[0]
            segment = self.segments[self._turn % len(self.segments)]
            self._turn += 1
            self._in_flight.append((stream, stream.launch_round(segment)))
            if stream.launched == len(stream.rounds):
                self._queue.popleft()

    def wait_oldest(self) -> None:
        """Block until the oldest round in flight is complete (watched like any collective)."""
        self._in_flight[0][1].wait()
        self.advance()


class _Stream:
    """One collective of a ring: its rounds (start, length) within each rank's range of the buffer."""

    op = ""

    def __init__(self, ring: SlotRing, size: int) -> None:
        self.ring, self.size = ring, size
        self.rounds = [(start, min(ring.piece, size - start)) for start in range(0, size, ring.piece)]
        self.launched = self.completed = 0

    def launch_round(self, segment: HostSlots) -> Pending:
        start, length = self.rounds[self.launched]
        self.launched += 1
        cut = segment.cut(self.ring.n * length, length)
        self.copy_in(cut, start, length)
        return cut.exchange(self.op, lambda: self.own_part(cut, start, length))

    def copy_in(self, cut: HostSlots, start: int, length: int) -> None:
        raise NotImplementedError

    def own_part(self, cut: HostSlots, start: int, length: int) -> None:
        raise NotImplementedError

    def done(self) -> bool:
        """Whether every round is complete (advances the ring; never blocks)."""
        self.ring.advance()
        return self.completed == len(self.rounds)

    def wait(self) -> None:
        while not self.done():
            self.ring.wait_oldest()


class _ReduceScatterRounds(_Stream):
    op = "reduce_scatter"

    def __init__(self, ring: SlotRing, read: Reader, out: torch.Tensor, size: int) -> None:
        super().__init__(ring, size)
        self.read, self.out = read, out

    def copy_in(self, cut: HostSlots, start: int, length: int) -> None:
        for k in range(self.ring.n):
            if k != self.ring.rank:
                self.read(k * self.size + start, cut.mine[k * length : (k + 1) * length])

    def own_part(self, cut: HostSlots, start: int, length: int) -> None:
        r = self.ring.rank
        mean = self.out[start : start + length]
        self.read(r * self.size + start, mean)
        for k in range(self.ring.n):
            if k != r:
                mean.add_(cut.slots[k, r * length : (r + 1) * length])
        mean.div_(self.ring.n)


class _GatherRounds(_Stream):
    op = "all_gather"

    def __init__(self, ring: SlotRing, size: int, flat: torch.Tensor) -> None:
        super().__init__(ring, size)
        self.flat = flat

    def piece(self, rank: int, start: int, length: int) -> torch.Tensor:
        """Elements [start, start + length) of `rank`'s range of `flat`."""
        base = rank * self.size + start
        return self.flat[base : base + length]

    def copy_in(self, cut: HostSlots, start: int, length: int) -> None:
        r = self.ring.rank
        cut.mine[r * length : (r + 1) * length].copy_(self.piece(r, start, length))

    def own_part(self, cut: HostSlots, start: int, length: int) -> None:
        for k in range(self.ring.n):
            if k != self.ring.rank:
                self.piece(k, start, length).copy_(cut.slots[k, k * length : (k + 1) * length])
