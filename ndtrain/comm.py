"""Counted, sequenced, time-limited collectives: the only place ndtrain calls c10d.

Every strategy communicates through a `Communicator`, naming the mesh axis (a `Group`) it works
on. Per (operation, axis) it counts calls, `payload` bytes (the tensor handed to the op) and
`wire` bytes: what each rank sends under the bandwidth-optimal ring algorithms, so that
measurements can be compared with the textbook volumes:

    all-reduce of S bytes over n ranks      2(n-1)/n · S
    all-gather / reduce-scatter, S = full   (n-1)/n · S
    broadcast of S bytes                    S (the root's send, pipelined)
    send / recv of S bytes                  S (counted on the sender)

Each collective gets a per-axis sequence number; a wait that exceeds the timeout raises an
error naming the operation, axis, sequence number and peers, which is what a hang diagnosis
needs. A group of one rank is a no-op that counts nothing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ndtrain.memory import tensor_bytes as _nbytes


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
    """An asynchronous collective in flight; `wait()` blocks until it is complete or times out."""

    def __init__(self, work: Any, description: str, timeout: timedelta) -> None:
        self._work = work
        self.description = description
        self._timeout = timeout

    def wait(self) -> None:
        if self._work is None:
            return
        try:
            self._work.wait(self._timeout)
        except RuntimeError as e:
            raise RuntimeError(f"{self.description} failed or timed out after {self._timeout}: {e}") from e
        self._work = None


class _AllWorks:
    """Several c10d works waited for as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self.works:
            work.wait(timeout) if timeout is not None else work.wait()
        return True


# torch 2.13 renamed the single-tensor collectives; older releases (>= 2.6) have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class Communicator:
    """Collectives on named groups, counted in `stats`."""

    def __init__(self, my_rank: int, timeout: timedelta) -> None:
        self.my_rank = my_rank
        self.timeout = timeout
        self.stats = CommStats()
        self._sequence: dict[str, int] = defaultdict(int)

    def _issue(self, op: str, group: Group, payload: int, wire: int) -> str:
        self._sequence[group.name] += 1
        self.stats.record(op, group.name, payload, wire)
        return (
            f"collective #{self._sequence[group.name]} {op} on axis {group.name!r} "
            f"(ranks {list(group.ranks)}) from rank {self.my_rank}"
        )

    def _finish(self, work: Any, description: str, async_op: bool) -> Pending | None:
        pending = Pending(work, description, self.timeout)
        if async_op:
            return pending
        pending.wait()
        return None

    def all_reduce(
        self, tensor: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> Pending | None:
        if group.size == 1:
            return Pending(None, "", self.timeout) if async_op else None
        n = group.size
        size = _nbytes(tensor)
        desc = self._issue("all_reduce", group, size, 2 * (n - 1) * size // n)
        work = dist.all_reduce(tensor, op=op, group=group.process_group, async_op=True)
        return self._finish(work, desc, async_op)

    def broadcast(self, tensor: torch.Tensor, group: Group, src: int = 0, async_op: bool = False) -> Pending | None:
        """Broadcast from group rank `src`."""
        if group.size == 1:
            return Pending(None, "", self.timeout) if async_op else None
        size = _nbytes(tensor)
        desc = self._issue("broadcast", group, size, size if group.rank == src else 0)
        work = dist.broadcast(tensor, src=group.global_rank(src), group=group.process_group, async_op=True)
        return self._finish(work, desc, async_op)

    def all_gather(
        self, output: torch.Tensor, shard: torch.Tensor, group: Group, async_op: bool = False
    ) -> Pending | None:
        """Concatenate every rank's `shard` (equal sizes) into `output`, in group order."""
        if group.size == 1:
            output.copy_(shard.reshape(output.shape))
            return Pending(None, "", self.timeout) if async_op else None
        n = group.size
        size = _nbytes(output)
        desc = self._issue("all_gather", group, size, (n - 1) * size // n)
        work = _all_gather_single(output, shard, group=group.process_group, async_op=True)
        return self._finish(work, desc, async_op)

    def reduce_scatter(
        self, shard: torch.Tensor, full: torch.Tensor, group: Group,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = False,
    ) -> Pending | None:
        """Reduce `full` over the group and leave this rank's equal part in `shard`."""
        if group.size == 1:
            shard.copy_(full.reshape(shard.shape))
            return Pending(None, "", self.timeout) if async_op else None
        n = group.size
        size = _nbytes(full)
        desc = self._issue("reduce_scatter", group, size, (n - 1) * size // n)
        work = _reduce_scatter_single(shard, full, op=op, group=group.process_group, async_op=True)
        return self._finish(work, desc, async_op)

    def send(self, tensor: torch.Tensor, group: Group, dst: int) -> Pending:
        """Asynchronous send to group rank `dst`."""
        size = _nbytes(tensor)
        desc = self._issue("send", group, size, size)
        work = dist.isend(tensor, dst=group.global_rank(dst), group=group.process_group)
        return Pending(work, desc, self.timeout)

    def recv(self, tensor: torch.Tensor, group: Group, src: int) -> Pending:
        """Asynchronous receive from group rank `src` (bytes are counted on the sender)."""
        desc = self._issue("recv", group, _nbytes(tensor), 0)
        work = dist.irecv(tensor, src=group.global_rank(src), group=group.process_group)
        return Pending(work, desc, self.timeout)

    def batch_send_recv(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
                        group: Group) -> Pending:
        """Post several sends and receives (`(tensor, group rank)` pairs) at once, as one batch.

        One `Pending` covers them all. Batching lets both neighbours post their exchanges in any
        order without deadlock (pipeline stages, ring attention)."""
        ops = []
        descs = []
        for tensor, peer in sends:
            size = _nbytes(tensor)
            descs.append(self._issue("send", group, size, size))
            ops.append(dist.P2POp(dist.isend, tensor, group.global_rank(peer), group.process_group))
        for tensor, peer in recvs:
            descs.append(self._issue("recv", group, _nbytes(tensor), 0))
            ops.append(dist.P2POp(dist.irecv, tensor, group.global_rank(peer), group.process_group))
        if not ops:
            return Pending(None, "", self.timeout)
        works = dist.batch_isend_irecv(ops)
        return Pending(_AllWorks(works), "; ".join(descs), self.timeout)

    def barrier(self, group: Group) -> None:
        if group.size == 1:
            return
        desc = self._issue("barrier", group, 0, 0)
        self._finish(dist.barrier(group=group.process_group, async_op=True), desc, async_op=False)

    def recv_any(self, tensor: torch.Tensor, group: Group) -> int:
        """Blocking receive from whichever member of `group` sends first; returns its group rank.

        For servers that serve many senders (parameter server). Bytes are counted on the sender."""
        desc = self._issue("recv_any", group, _nbytes(tensor), 0)
        work = dist.irecv(tensor, src=None, group=group.process_group)
        Pending(work, desc, self.timeout).wait()
        return group.ranks.index(dist.get_global_rank(group.process_group, work._source_rank()))
