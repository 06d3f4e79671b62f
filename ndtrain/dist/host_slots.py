"""Reductions between the ranks of one host through shared memory, instead of the backend's sockets.

On CPU, gloo moves a collective's bytes through TCP over the loopback device: the kernel copies
every byte out of the sender and into the receiver, gloo's threads reduce them, and all of it
competes with the training step for the same cores. When every rank of a group runs on one host
(the same /dev/shm), `HostSlots` gives the group one shared-memory segment of N slots, one per
group rank, each `numel` elements: rank r's gradient bucket lives in slot r, and a collective is
carried out by the ranks reading each other's slots directly:

- `all_reduce_mean()`: rank r averages chunk r (1/N of the slot, cut at 64-byte boundaries) over
  the N slots and writes the result into chunk r of every slot; afterwards every slot holds the
  whole mean. Each rank reads (N−1)/N·S bytes of the others' slots and writes (N−1)/N·S into them
  (S = slot bytes): 2(N−1)/N·S moved between processes, the ring all-reduce's volume, counted as
  that, with no copy through the kernel.
- `reduce_scatter_mean()`: rank r averages chunk r into its own slot only: (N−1)/N·S read.

`exchange(op, own_part)` is a collective whose part on each rank is the caller's: dist/host_stream.py
streams a buffer through a ring of small segments, each round reading the others' slots straight
into the caller's buffers.

`cut(numel, chunk)` sees the same segment as slots of their first `numel` elements, cut into parts of
`chunk`: ZeRO-2's buckets, of different sizes, take turns on a few segments sized for the largest
(zero2_gradients.py). A cut shares the segment's header and sequence numbers, so its collectives
are the segment's, one at a time, in the same order on every rank; S is then the cut's bytes.

Synchronisation: a header of per-rank sequence numbers, each written only by its rank:
`arrived[r] = seq` once slot r holds the rank's data for the collective #seq, `done[r] = seq` once
rank r's part is written. A rank reads another's slot only between everyone's arrival and its own
`done`, and touches its own slot again only after every rank is done with the collective, so a
slot has one writer at a time and every chunk one writer. A collective is asynchronous: `Pending.done()`
advances it without blocking (the bucket layer polls during backward, so a rank does its chunk as
soon as the others arrive), `Pending.wait()` polls until it is complete (yielding the core, under
the communicator's timeout and watchdog, as any other wait). The store order relies on x86-64's
memory model (stores become visible in program order), so the slots are used on x86-64 Linux only.

A peer that ends (killed, crashed, exited) never writes its flags again. The slots notice it
instead of waiting for the watchdog (an agent's SIGTERM to the survivor only asks it to stop at the
next step, so without this it would wait out the agent's grace): at setup every rank records its
pid, its start time (field 22 of /proc/self/stat) and its PID namespace in the header; a rank checks
its peers only where all share its PID namespace and /proc shows each peer's recorded start (else
no checking, as for ranks in containers sharing /dev/shm). A waiting rank, once it naps between
polls, reads /proc/PID/stat of each peer whose flag lags the collective: one small file read per
lagging peer per nap (naps grow from 20 µs to 1 ms), nothing while the collective progresses. A
peer that is gone, whose pid names another process, or that is a zombie ends the wait with
`PeerFailed` (failures.py: a lost peer, so the run restarts), one line naming its group and global
rank and its pid.

Setup (collective, once per segment): group rank 0 creates a file of a random name in /dev/shm
and broadcasts the name; every rank maps it and signs the header (pid, start, namespace; one /proc
read per peer afterwards to verify them); an all-reduce says whether every rank could open it
(not, when the ranks are on different hosts or in different /dev/shm namespaces: then `open`
returns None on every rank and the caller keeps the backend's collectives); rank 0 unlinks the
file, so nothing is left behind after the processes end, however they end. Memory: S bytes per
rank of shared pages, replacing the S-byte private buffer the bucket held (ZeRO-2: the staging
buffers of the buckets that take turns on the segment); a rank's resident set also counts the
(N−1)/N·S of the other slots it touches (pages that are not duplicated).
"""

from __future__ import annotations

import copy
import functools
import itertools
import os
import platform
import secrets
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from ndtrain.dist.comm import Communicator, Group, Pending
from ndtrain.dist.procfs import proc_stat
from ndtrain.failures import PeerFailed

SHARED_MEMORY = Path("/dev/shm")
_LINE = 64  # bytes: slots and chunks start on cache lines, so two writers never share one
_SPINS = 64  # yields before a waiting rank starts to sleep between polls
_NAP_S = (20e-6, 1e-3)  # first and longest sleep between polls after the yields
_ROWS = 5  # header rows of N int64: arrived, done (the flags); pid, start time, PID namespace (the identities)


def host_slots_supported() -> bool:
    """Whether this process can use shared-memory slots at all (x86-64 Linux); `HostSlots.open` asks
    every rank, so a group whose hosts differ falls back as a whole."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


class HostSlots:
    """N slots of `numel` elements of `dtype` in one shared-memory segment, slot r for group rank r."""

    def __init__(self, raw: torch.Tensor, comm: Communicator, group: Group, numel: int, dtype: torch.dtype,
                 chunk: int | None = None) -> None:
        n = group.size
        self.comm, self.group, self.numel, self.dtype = comm, group, numel, dtype
        header = _header_bytes(n)
        stride = _round_up(numel * dtype.itemsize, _LINE) // dtype.itemsize
        rows = _header(raw, n)
        self._flags = rows[:2]  # [arrived, done] per rank
        self._peers = _watched_peers(rows[2:], group.rank)  # group rank → (pid, start) of the peers checked
        self.slots = raw[header : header + n * stride * dtype.itemsize].view(dtype).view(n, stride)[:, :numel]
        self.mine = self.slots[group.rank]
        self.chunks = _chunks(numel, n, _round_up(-(-numel // n), _LINE // dtype.itemsize) if chunk is None else chunk)
        self._sequence = itertools.count(1)  # collective numbers on this segment, shared with its cuts

    @staticmethod
    def open(comm: Communicator, group: Group, numel: int, dtype: torch.dtype, *, chunk: int | None = None,
             directory: Path = SHARED_MEMORY) -> HostSlots | None:
        """Collective over `group` (CPU tensors): the segment, or None on every rank when some rank cannot
        map it (another host, another /dev/shm, not x86-64 Linux).

        `chunk`: elements of each rank's part (rank r's is [r·chunk, (r+1)·chunk) ∩ [0, numel)), to
        match a caller's layout (ZeRO-1's `FlatLayout`); default: numel / N rounded up to a cache line.
        `directory`: where the segment is made (a tmpfs shared by the ranks)."""
        n = group.size
        size = _header_bytes(n) + n * _round_up(numel * dtype.itemsize, _LINE)
        token = torch.zeros(2, dtype=torch.int64)  # the segment's name, 0 when rank 0 could not create it
        raw = None
        if group.rank == 0 and host_slots_supported():
            token.copy_(torch.tensor([secrets.randbits(63) | 1, secrets.randbits(63)]))
            raw = _create(_segment(directory, token), size)
            if raw is None:
                token.zero_()
        comm.broadcast(token, group, src=0)
        if group.rank != 0 and token[0].item() != 0 and host_slots_supported():
            raw = _map(_segment(directory, token), size)
        if raw is not None:
            _sign(_header(raw, n)[2:], group.rank)  # before the all-reduce: every rank's is there after it
        opened = torch.tensor([0 if raw is None else 1], dtype=torch.int64)
        comm.all_reduce(opened, group, op=torch.distributed.ReduceOp.MIN)
        if group.rank == 0 and raw is not None:
            _segment(directory, token).unlink(missing_ok=True)
        if raw is None or opened.item() == 0:
            return None
        return HostSlots(raw, comm, group, numel, dtype, chunk)

    def cut(self, numel: int, chunk: int) -> HostSlots:
        """The same segment as slots of their first `numel` elements, rank r's part [r·chunk, (r+1)·chunk)
        (ZeRO-2's buckets of different sizes taking turns on one segment, zero2_gradients.py). It shares
        the header and the sequence numbers: a collective on either is the segment's next collective."""
        if numel > self.numel:
            raise ValueError(f"a cut of {numel} elements does not fit slots of {self.numel}")
        part = copy.copy(self)
        part.numel, part.slots = numel, self.slots[:, :numel]
        part.mine, part.chunks = part.slots[self.group.rank], _chunks(numel, self.group.size, chunk)
        return part

    def all_reduce_mean(self) -> Pending:
        """Every slot becomes the mean of all slots (this rank's slot must hold its data)."""
        return self._start("all_reduce", functools.partial(_average_into_every_slot, self), passes=2)

    def reduce_scatter_mean(self) -> Pending:
        """Chunk r of this rank's slot becomes the mean of chunk r over all slots (the rest is untouched)."""
        return self._start("reduce_scatter", functools.partial(_average_own_chunk, self))

    def exchange(self, op: str, own_part: Callable[[], None]) -> Pending:
        """A collective whose part on this rank is `own_part()`, run once every rank's slot holds its data
        (this rank's slot must hold its own): it may read the others' slots and write anywhere but into
        them (dist/host_stream.py's rounds). Counted under `{op}_shm` as (N−1)/N of the slot bytes moved."""
        return self._start(op, own_part)

    def _start(self, op: str, own_part: Callable[[], Any], passes: int = 1) -> Pending:
        """`passes`: times (N−1)/N of the slot moves between the processes."""
        seq = next(self._sequence)
        n = self.group.size
        size = self.numel * self.dtype.itemsize
        work = _Collective(self, seq, own_part)
        self._flags[0, self.group.rank] = seq  # after every write of this slot, in program order
        return self.comm.watch(work, f"{op}_shm", self.group, size, (n - 1) * size // n * passes)


class _Collective:
    """One collective on the slots: `is_completed()` advances it without blocking (this rank's part,
    `own_part()`, once every rank has arrived), `wait` polls it."""

    def __init__(self, slots: HostSlots, seq: int, own_part: Callable[[], Any]) -> None:
        self.s, self.seq, self.own_part = slots, seq, own_part
        self._mine_done = self._complete = False

    def is_completed(self) -> bool:
        if self._complete:
            return True
        flags = self.s._flags
        if not self._mine_done:
            if int(flags[0].min()) < self.seq:
                return False
            self.own_part()
            flags[1, self.s.group.rank] = self.seq
            self._mine_done = True
        if int(flags[1].min()) < self.seq:
            return False
        self._complete = True
        return True

    def wait(self, timeout: timedelta | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        polls, nap = 0, _NAP_S[0]
        while not self.is_completed():
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"shared-memory collective #{self.seq} did not complete in time")
            polls += 1
            if polls < _SPINS:
                os.sched_yield()
            else:  # a peer is far behind (or gone): wake up less and less often
                self._check_peers()
                time.sleep(nap)
                nap = min(2 * nap, _NAP_S[1])
        return True

    def _check_peers(self) -> None:
        """Raise `PeerFailed` if a peer whose flag lags this collective has ended: one /proc read per
        lagging peer (none where setup found the peers' processes not visible, `_watched_peers`)."""
        s = self.s
        lagging = s._flags[1 if self._mine_done else 0]
        for k, (pid, start) in s._peers.items():
            if int(lagging[k]) >= self.seq:
                continue
            ended = _ended(pid, start)
            if ended is not None and int(lagging[k]) < self.seq:  # read again: it may have written, then exited
                raise PeerFailed(f"shared-memory collective #{self.seq} on axis '{s.group.name}': group rank {k} "
                                 f"(global rank {s.group.global_rank(k)}, pid {pid}) {ended}")


def _average_into_every_slot(s: HostSlots) -> None:
    """All-reduce: chunk r's mean (`_average_own_chunk`) written into chunk r of every other slot too."""
    mean = _average_own_chunk(s)
    lo, hi = s.chunks[s.group.rank]
    for k in range(s.group.size):
        if k != s.group.rank and lo < hi:
            s.slots[k, lo:hi].copy_(mean)


def _average_own_chunk(s: HostSlots) -> torch.Tensor:
    """Chunk r of this rank's slot, replaced by its mean over the slots (summed in slot order from this rank's)."""
    lo, hi = s.chunks[s.group.rank]
    mean = s.mine[lo:hi]
    if lo < hi:
        for k in range(s.group.size):
            if k != s.group.rank:
                mean.add_(s.slots[k, lo:hi])
        mean.div_(s.group.size)
    return mean


def _chunks(numel: int, n: int, chunk: int) -> list[tuple[int, int]]:
    """Rank r's part of a slot of `numel` elements: [r·chunk, (r+1)·chunk) ∩ [0, numel)."""
    if chunk * n < numel:
        raise ValueError(f"{n} chunks of {chunk} elements do not cover {numel}")
    return [(min(numel, k * chunk), min(numel, (k + 1) * chunk)) for k in range(n)]


def _header_bytes(n: int) -> int:
    return _round_up(_ROWS * n * 8, _LINE)


def _header(raw: torch.Tensor, n: int) -> torch.Tensor:
    """The segment's header as [_ROWS, n] int64 (rows: arrived, done, pid, start time, PID namespace)."""
    return raw[: _header_bytes(n)].view(torch.int64)[: _ROWS * n].view(_ROWS, n)


def _sign(identities: torch.Tensor, rank: int) -> None:
    """This process's pid, start time and PID namespace into column `rank` of `identities` ([3, n];
    0 for what cannot be read, or where /proc is another PID namespace's: then nobody checks)."""
    stat = proc_stat(os.getpid())
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino if os.readlink("/proc/self") == str(os.getpid()) else 0
    except OSError:
        namespace = 0
    identities[:, rank] = torch.tensor([os.getpid(), 0 if stat is None else stat[1], namespace])


def _watched_peers(identities: torch.Tensor, rank: int) -> dict[int, tuple[int, int]]:
    """Group rank → (pid, start time) of every other rank, where this process can tell when they end
    (every rank in its PID namespace, /proc showing each peer with its recorded start); else {}.
    Every rank reads the same header, so all decide alike unless a peer ended meanwhile. Cost: one
    /proc read per peer, once per segment."""
    pids, starts, namespaces = identities.tolist()
    if 0 in starts or 0 in namespaces or len(set(namespaces)) != 1:
        return {}
    peers = {k: (pids[k], starts[k]) for k in range(len(pids)) if k != rank}
    return {} if any(_ended(pid, start) for pid, start in peers.values()) else peers


def _ended(pid: int, start: int) -> str | None:
    """How the process `pid` started at `start` (clock ticks after boot) ended, or None while it runs."""
    stat = proc_stat(pid)
    if stat is None:
        return "ended: its process is gone"
    if stat[1] != start:
        return "ended: its pid names another process now"
    if stat[0] in ("Z", "X"):
        return "ended: its process exited (a zombie)"
    return None


def _segment(directory: Path, token: torch.Tensor) -> Path:
    return directory / f"ndtrain-{token[0].item():x}-{token[1].item():x}"


def _create(path: Path, size: int) -> torch.Tensor | None:
    """A new zero-filled file of `size` bytes at `path`, mapped shared; None if it cannot be made."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
    except OSError:
        return None
    mapped = _map(path, size)
    if mapped is None:
        path.unlink(missing_ok=True)
    return mapped


def _map(path: Path, size: int) -> torch.Tensor | None:
    """The existing file at `path` mapped shared as `size` bytes; None where there is no such file
    (another host's /dev/shm) or it cannot be mapped."""
    if not path.is_file() or path.stat().st_size != size:
        return None
    try:
        return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
    except RuntimeError:
        return None


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
