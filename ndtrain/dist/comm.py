"""Counted, sequenced, time-limited collectives: the only place ndtrain calls c10d.

Every strategy communicates through a `Communicator`, naming the mesh axis (a `Group`) it works
on. Per (operation, axis) it counts calls, `payload` bytes (the tensor handed to the op) and
`wire` bytes: what each rank sends under the bandwidth-optimal ring algorithms, so that
measurements can be compared with the textbook volumes:

    all-reduce of S bytes over n ranks      2(n-1)/n · S
    all-gather / reduce-scatter, S = full   (n-1)/n · S
    broadcast of S bytes                    S (the root's send, pipelined)
    uneven all-gather, n_r rows of R bytes  8(n-1) + (n-1)·max_r n_r·R (sizes, then padded rows)
    send / recv of S bytes                  S (counted on the sender)

Each collective gets a per-axis sequence number. Every wait arms the communicator's `Watchdog`
(if it has one: `mesh.init` gives one to every multi-process run) with the operation, axis,
sequence number and peers, so a stall becomes one message naming the ranks that did not arrive
(see dist/watchdog.py); a wait that fails or exceeds `timeout` raises an error naming the same. A
group of one rank is a no-op that counts nothing.

On NCCL a wait is the stream wait only (`work.wait()` without a timeout): ProcessGroupNCCL's `wait`
given a timeout blocks the host until the collective has finished, which would make every bucket
wait, pipeline receive and ring exchange a host synchronisation. There the process group's own
timeout (set at `init_process_group` from `parallel.timeout_s`) and NCCL's watchdog bound a wait;
on gloo (and the shared-memory transport) the wait itself is timed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ndtrain.dist.memory import tensor_bytes as _nbytes
from ndtrain.dist.watchdog import Wait, Watchdog


@dataclass(frozen=True)
class Group:
    """One communicator: the global ranks it spans (in group order) and this rank's place."""

    name: str
    ranks: tuple[int, ...]
    rank: int
    process_group: Any = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank % self.size]

    @property
    def next_rank(self) -> int:
        """Global rank of the next member around the ring."""
        return self.global_rank(self.rank + 1)

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous member around the ring."""
        return self.global_rank(self.rank - 1)


@dataclass
class OpCount:
    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: int = 0


@dataclass
class CommStats:
    """Counters per "op/axis"; `snapshot()` copies them, `total_wire_bytes()` sums them."""

    counts: dict[str, OpCount] = field(default_factory=lambda: defaultdict(OpCount))

    def record(self, op: str, axis: str, payload: int, wire: int) -> None:
        entry = self.counts[f"{op}/{axis}"]
        entry.calls += 1
        entry.payload_bytes += payload
        entry.wire_bytes += wire

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {k: vars(v).copy() for k, v in sorted(self.counts.items())}

    def total_wire_bytes(self) -> int:
        return sum(v.wire_bytes for v in self.counts.values())

    def total_calls(self) -> int:
        return sum(v.calls for v in self.counts.values())


class Pending:
    """An asynchronous operation in flight; `wait()` blocks until it is complete, under the watchdog."""

    def __init__(self, work: Any, wait: Wait | None, timeout: timedelta, watchdog: Watchdog | None = None,
                 stream_wait: bool = False) -> None:
        self._work = work
        self._wait = wait
        self._timeout = timeout
        self._watchdog = watchdog
        self._stream_wait = stream_wait  # NCCL: make the current stream wait, never block the host

    @property
    def description(self) -> str:
        return self._wait.describe() if self._wait is not None else ""

    def done(self) -> bool:
        """Whether the operation has completed (never blocks); `wait()` is still needed to settle it."""
        return self._work is None or bool(self._work.is_completed())

    def wait(self) -> None:
        if self._work is None:
            return
        if self._watchdog is not None and self._wait is not None:
            self._watchdog.arm(self._wait)
        try:
            self._work.wait() if self._stream_wait else self._work.wait(self._timeout)
        except RuntimeError as e:
            if self._watchdog is not None:
                self._watchdog.hold_if_stalled()
            raise RuntimeError(f"{self.description} failed or timed out after {self._timeout}: {e}") from e
        finally:
            if self._watchdog is not None:
                self._watchdog.disarm()
        self._work = None


class _AllWorks:
    """Several c10d works waited for as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self.works:
            work.wait(timeout) if timeout is not None else work.wait()
        return True


class _Watched:
    """An operation carried out outside c10d (`Communicator.watch`): its wait is always timed."""

    def __init__(self, work: Any) -> None:
        self.work = work

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def wait(self, timeout: timedelta | None = None) -> Any:
        return self.work.wait(timeout)


def _on_nccl(group: Group) -> bool:
    """Whether `group`'s collectives run on NCCL (their waits are stream waits)."""
    return group.process_group is not None and dist.get_backend(group.process_group) == "nccl"


# torch 2.13 renamed the single-tensor collectives; older releases (>= 2.6) have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class Communicator:
    """Collectives on named groups, counted in `stats`, each wait watched by `watchdog` (if any)."""

    def __init__(self, my_rank: int, timeout: timedelta, watchdog: Watchdog | None = None) -> None:
        self.my_rank = my_rank
        self.timeout = timeout
        self.stats = CommStats()
        self.issued: dict[str, int] = defaultdict(int)  # per axis: sequence number of the last op issued
        self.watchdog = watchdog

    def _issue(self, op: str, group: Group, payload: int, wire: int) -> int:
        self.issued[group.name] += 1
        self.stats.record(op, group.name, payload, wire)
        return self.issued[group.name]

    def _pending(self, work: Any, op: str, group: Group, seq: int, peers: tuple[int, ...] | None = None) -> Pending:
        wait = Wait(op, group.name, seq, group.ranks, group.ranks if peers is None else peers, peers is None)
        return Pending(work, wait, self.timeout, self.watchdog, stream_wait=_on_nccl(group) and not isinstance(work, _Watched))

    def _done(self) -> Pending:
        return Pending(None, None, self.timeout)

    def _finish(self, work: Any, op: str, group: Group, seq: int, async_op: bool) -> Pending | None:
        pending = self._pending(work, op, group, seq)
        if async_op:
            return pending
        pending.wait()
        return None

    def all_reduce(
        self, tensor: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> Pending | None:
        if group.size == 1:
            return self._done() if async_op else None
        n = group.size
        size = _nbytes(tensor)
        seq = self._issue("all_reduce", group, size, 2 * (n - 1) * size // n)
        work = dist.all_reduce(tensor, op=op, group=group.process_group, async_op=True)
        return self._finish(work, "all_reduce", group, seq, async_op)

    def broadcast(self, tensor: torch.Tensor, group: Group, src: int = 0, async_op: bool = False) -> Pending | None:
        """Broadcast from group rank `src`."""
        if group.size == 1:
            return self._done() if async_op else None
        size = _nbytes(tensor)
        seq = self._issue("broadcast", group, size, size if group.rank == src else 0)
        work = dist.broadcast(tensor, src=group.global_rank(src), group=group.process_group, async_op=True)
        return self._finish(work, "broadcast", group, seq, async_op)

    def all_gather(
        self, output: torch.Tensor, shard: torch.Tensor, group: Group, async_op: bool = False
    ) -> Pending | None:
        """Concatenate every rank's `shard` (equal sizes) into `output`, in group order."""
        if group.size == 1:
            output.copy_(shard.reshape(output.shape))
            return self._done() if async_op else None
        n = group.size
        size = _nbytes(output)
        seq = self._issue("all_gather", group, size, (n - 1) * size // n)
        work = _all_gather_single(output, shard, group=group.process_group, async_op=True)
        return self._finish(work, "all_gather", group, seq, async_op)

    def all_gather_uneven(self, shard: torch.Tensor, group: Group) -> torch.Tensor:
        """Concatenate every rank's `shard` [n_r, ...] in group order; n_r may differ and be 0.

        The trailing shape and dtype must be the same on every rank. Two collectives: an
        all-gather of the n row counts (int64), then one all-gather of the shards padded to
        m = max_r n_r rows (skipped when m = 0), from which the padding is cut. Each rank sends
        8(n−1) + (n−1)·m·R bytes for rows of R bytes: the padding costs (n−1)·(m − n_r)·R over an
        exact variable-size gather, nothing when the shards are equal. Counted as
        "all_gather_uneven" (both collectives, each with its sequence number, under the watchdog)."""
        if group.size == 1:
            return shard.clone()
        n = group.size
        device = shard.device
        sizes = torch.empty(n, dtype=torch.int64, device=device)
        count = torch.tensor([shard.shape[0]], dtype=torch.int64, device=device)
        seq = self._issue("all_gather_uneven", group, _nbytes(sizes), (n - 1) * _nbytes(count))
        work = _all_gather_single(sizes, count, group=group.process_group, async_op=True)
        self._finish(work, "all_gather_uneven", group, seq, async_op=False)
        rows = sizes.tolist()
        longest = max(rows)
        row_shape = tuple(shard.shape[1:])
        if longest == 0:
            return shard.new_empty((0, *row_shape))
        padded = shard.new_zeros((longest, *row_shape))
        padded[: shard.shape[0]] = shard
        gathered = shard.new_empty((n * longest, *row_shape))
        size = _nbytes(gathered)
        seq = self._issue("all_gather_uneven", group, size, (n - 1) * size // n)
        work = _all_gather_single(gathered, padded, group=group.process_group, async_op=True)
        self._finish(work, "all_gather_uneven", group, seq, async_op=False)
        return torch.cat([gathered[r * longest : r * longest + rows[r]] for r in range(n)])

    def reduce_scatter(
        self, shard: torch.Tensor, full: torch.Tensor, group: Group,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = False,
    ) -> Pending | None:
        """Reduce `full` over the group and leave this rank's equal part in `shard`."""
        if group.size == 1:
            shard.copy_(full.reshape(shard.shape))
            return self._done() if async_op else None
        n = group.size
        size = _nbytes(full)
        seq = self._issue("reduce_scatter", group, size, (n - 1) * size // n)
        work = _reduce_scatter_single(shard, full, op=op, group=group.process_group, async_op=True)
        return self._finish(work, "reduce_scatter", group, seq, async_op)

    def send(self, tensor: torch.Tensor, group: Group, dst: int) -> Pending:
        """Asynchronous send to group rank `dst`."""
        size = _nbytes(tensor)
        seq = self._issue("send", group, size, size)
        work = dist.isend(tensor, dst=group.global_rank(dst), group=group.process_group)
        return self._pending(work, "send", group, seq, (group.global_rank(dst),))

    def recv(self, tensor: torch.Tensor, group: Group, src: int) -> Pending:
        """Asynchronous receive from group rank `src` (bytes are counted on the sender)."""
        seq = self._issue("recv", group, _nbytes(tensor), 0)
        work = dist.irecv(tensor, src=group.global_rank(src), group=group.process_group)
        return self._pending(work, "recv", group, seq, (group.global_rank(src),))

    def batch_send_recv(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
                        group: Group) -> Pending:
        """Post several sends and receives (`(tensor, group rank)` pairs) at once, as one batch.

        One `Pending` covers them all (named by the first op's sequence number). Batching lets both
        neighbours post their exchanges in any order without deadlock (pipeline stages, ring attention)."""
        ops = []
        seqs = []
        for tensor, peer in sends:
            size = _nbytes(tensor)
            seqs.append(self._issue("send", group, size, size))
            ops.append(dist.P2POp(dist.isend, tensor, group.global_rank(peer), group.process_group))
        for tensor, peer in recvs:
            seqs.append(self._issue("recv", group, _nbytes(tensor), 0))
            ops.append(dist.P2POp(dist.irecv, tensor, group.global_rank(peer), group.process_group))
        if not ops:
            return self._done()
        works = dist.batch_isend_irecv(ops)
        name = "+".join(kind for kind, pairs in (("send", sends), ("recv", recvs)) if pairs)
        peers = tuple(sorted({group.global_rank(peer) for _, peer in sends + recvs}))
        return self._pending(_AllWorks(works), name, group, seqs[0], peers)

    def watch(self, work: Any, op: str, group: Group, payload: int, wire: int) -> Pending:
        """Count and sequence an operation carried out outside c10d (`work`: `is_completed()` and
        `wait(timeout)`, e.g. dist/host_slots.py's shared-memory collectives); its wait is watched as any other."""
        seq = self._issue(op, group, payload, wire)
        return self._pending(_Watched(work), op, group, seq)

    def barrier(self, group: Group) -> None:
        if group.size == 1:
            return
        seq = self._issue("barrier", group, 0, 0)
        self._finish(dist.barrier(group=group.process_group, async_op=True), "barrier", group, seq, async_op=False)

    def recv_any(self, tensor: torch.Tensor, group: Group) -> int:
        """Blocking receive from whichever member of `group` sends first; returns its group rank.

        For servers that serve many senders (parameter server). Bytes are counted on the sender."""
        seq = self._issue("recv_any", group, _nbytes(tensor), 0)
        work = dist.irecv(tensor, src=None, group=group.process_group)
        peers = tuple(r for r in group.ranks if r != self.my_rank)
        self._pending(work, "recv_any", group, seq, peers).wait()
        return group.ranks.index(dist.get_global_rank(group.process_group, work._source_rank()))
