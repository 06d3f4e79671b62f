"""Gradient buckets whose flat buffer is this rank's slot of a shared-memory segment (dist/host_slots.py).

For CPU groups whose ranks all run on one host: DDP's bucket of B bytes is averaged by the ranks
reading and writing each other's slots (`HostSlots.all_reduce_mean`: 2(N−1)/N·B bytes moved
between processes, the ring's volume, without the kernel's socket copies or gloo's threads).
(ZeRO-1 streams its buckets through a ring of small segments instead: dist/host_stream.py.) ZeRO-2's buckets
(zero2_gradients.py) take turns on a pool of MAX_IN_FLIGHT + 1 segments opened here too, each sized
for the largest bucket: a bucket's staging buffer is its slot while it is filled and in flight,
(N−1)/N·B' read per bucket; the pool's pages, (MAX_IN_FLIGHT + 1)·B'max per rank, replace the
transient private staging buffers. Where the slots cannot be shared (ranks on several hosts, a
device other than the CPU, a comm dtype other than the gradients'), the factories return the
backend's bucket (ZeRO-2: no pool), decided alike on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from ndtrain.dist.comm import Communicator, Group
from ndtrain.dist.host_slots import HostSlots
from ndtrain.parallel.data.buckets import AllReduceBucket, Bucket
from ndtrain.parallel.data.flat_layout import FlatLayout
from ndtrain.parallel.precision import reduction_dtype


def open_bucket_slots(params: list[nn.Parameter], comm: Communicator, group: Group, comm_dtype: torch.dtype,
                      numel: int, chunk: int | None = None) -> HostSlots | None:
    """Shared slots of `numel` elements for a bucket of `params`, or None where the backend must reduce
    it (one rank, not the CPU, or a comm dtype that differs from the gradients': the slots reduce in place)."""
    dtype = params[0].dtype
    if group.size == 1 or params[0].device.type != "cpu" or reduction_dtype(comm_dtype, dtype) != dtype:
        return None
    return HostSlots.open(comm, group, numel, dtype, chunk=chunk)


class HostAllReduceBucket(AllReduceBucket):
    """A DDP bucket in this rank's shared-memory slot, averaged through the slots (nothing to divide after)."""

    def __init__(self, params: list[nn.Parameter], comm: Communicator, group: Group, comm_dtype: torch.dtype,
                 slots: HostSlots) -> None:
        super().__init__(params, comm, group, comm_dtype, storage=slots.mine)
        self.slots: HostSlots = slots

    def launch(self) -> None:
        self.pending = self.slots.all_reduce_mean()

    def complete(self) -> None:
        assert self.pending is not None
        self.pending.wait()
        self.pending = None


def host_all_reduce_bucket(params: list[nn.Parameter], comm: Communicator, group: Group, comm_dtype: torch.dtype) -> Bucket:
    """A `HostAllReduceBucket` where its slots can be shared, else an `AllReduceBucket` (a `BucketKind`)."""
    slots = open_bucket_slots(params, comm, group, comm_dtype, FlatLayout(params, 1, 0).numel)
    if slots is None:
        return AllReduceBucket(params, comm, group, comm_dtype)
    return HostAllReduceBucket(params, comm, group, comm_dtype, slots)
