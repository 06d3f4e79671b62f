"""ZeRO stage 1's gradient side: DDP's full local gradients, reduce-scattered into this rank's shard.

What is split: nothing of the gradient's memory. `Zero1DataParallel` is `DistributedDataParallel`
(ddp.py: same packing, hooks, `no_sync`, unused-parameter handling) whose buckets are
`ShardReduceBucket`s: each bucket is one flat gradient buffer laid out by a `FlatLayout` over the N
ranks of `ctx.group("dp_cp")` (padded with zeros to a multiple of N), and every `param.grad` is a
view of it, so autograd accumulates straight into it, inside `no_sync` too: gradient accumulation
over micro-batches stays local, in full gradients (ZeRO-2, zero2_gradients.py, instead reduces
every micro-batch and keeps only the shard).

What is communicated, and when: at the synchronising backward, as soon as a bucket's gradients
have all arrived (strictly in bucket order, overlapping the rest of backward, by the bucket layer
of buckets.py), the bucket is reduce-scattered *in place*: rank r's range [r·s, (r+1)·s) of the
flat buffer then holds the sum over the ranks, divided by N when the bucket is completed. Only
that range is the averaged gradient; the rest of the buffer keeps this rank's local gradient
until `zero_grad`. `ZeroOptimizer` (zero1_optimizer.py) reads exactly that range, then
gathers the updated parameters. Exception: under pipeline parallelism the bucket holding a tied
embedding/head weight is all-reduced whole, because the pipeline runner sums the two stages'
copies of that gradient elementwise after backward, and the copies sit at different offsets of
different buckets on the two stages.

Cost per synchronising step, Ψ' padded elements, G = Ψ'·comm itemsize, N ranks: each rank sends
(N−1)/N·G (reduce-scatter) instead of DDP's 2(N−1)/N·G; with ZeroOptimizer's all-gather of the
parameters, 2(N−1)/N·4Ψ' in all for fp32 (DDP's volume). Memory: the full gradient 4Ψ' (as DDP),
plus one comm-dtype copy of each bucket when the comm dtype differs from the gradients'.
On gloo (CPU) `reduce_scatter_tensor` is carried out as an all-reduce of a copy of the input: it
sends 2(N−1)/N·G, the volume of the all-reduce it replaces, and allocates a transient copy of the
bucket; NCCL reduce-scatters in place at (N−1)/N·G. On one CPU host (`host_slots`, the engine's
default there) the bucket is this rank's slot of a shared-memory segment (`HostShardReduceBucket`,
host_slots.py): rank r averages its range straight out of the other slots, (N−1)/N·G read, no copy;
`ZeroOptimizer` then gathers the updated parameters through the same slots, each rank writing its
range into the others' slots, so after the step a slot's ranges outside its own rank's hold the
other ranks' new parameters (not gradients) until `zero_grad`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ndtrain.comm import Communicator, Group
from ndtrain.host_slots import HostSlots
from ndtrain.mesh import ParallelContext
from ndtrain.parallel.buckets import AllReduceBucket, Bucket
from ndtrain.parallel.ddp import DistributedDataParallel
from ndtrain.parallel.flat_layout import FlatLayout
from ndtrain.parallel.host_buckets import HostAllReduceBucket, open_bucket_slots
from ndtrain.parallel.precision import reduction_dtype


class ShardReduceBucket(AllReduceBucket):
    """A DDP bucket (full `flat` gradient, `.grad`s are its `views`) padded to a multiple of N and
    reduce-scattered in place: after `complete()` only this rank's range [lo, hi) is averaged.
    A bucket holding a parameter of `whole` (a pipeline-tied weight, whose two copies the pipeline
    runner sums whole after backward) is all-reduced instead, as DDP does."""

    def __init__(self, params: list[nn.Parameter], comm: Communicator, group: Group, comm_dtype: torch.dtype,
                 whole: frozenset[int] = frozenset(), storage: torch.Tensor | None = None) -> None:
        """`storage`: the zeroed flat buffer of `FlatLayout(params, N, rank).padded` elements to use (a
        shared-memory slot, host_buckets.py); None: a new one."""
        Bucket.__init__(self, params, comm, group, FlatLayout(params, group.size, group.rank))
        self.flat = torch.zeros(self.flat_layout.padded, dtype=params[0].dtype, device=params[0].device) if storage is None else storage
        self.views = self.flat_layout.views(self.flat)
        dtype = reduction_dtype(comm_dtype, self.flat.dtype)
        needs_cast = dtype != self.flat.dtype and group.size > 1
        self.comm = torch.zeros_like(self.flat, dtype=dtype) if needs_cast else self.flat  # what is reduced
        self.averaged = slice(0, None) if any(id(p) in whole for p in params) else slice(self.flat_layout.lo, self.flat_layout.hi)
        for param, view in zip(params, self.views):
            if param.grad is not None:
                view.copy_(param.grad)
            param.grad = view

    def launch(self) -> None:
        if self.group.size == 1:
            return
        if self.comm is not self.flat:
            self.comm.copy_(self.flat)
        if self.averaged.stop is None:
            self.pending = self.communicator.all_reduce(self.comm, self.group, async_op=True)
        else:
            self.pending = self.communicator.reduce_scatter(self.comm[self.averaged], self.comm, self.group, async_op=True)

    def complete(self) -> None:
        if self.group.size == 1:
            return
        assert self.pending is not None
        self.pending.wait()
        self.pending = None
        if self.comm is not self.flat:
            self.flat[self.averaged].copy_(self.comm[self.averaged])
        self.flat[self.averaged].div_(self.group.size)


class HostShardReduceBucket(ShardReduceBucket):
    """A ZeRO-1 bucket in this rank's shared-memory slot (host_buckets.py), reduce-scattered through the
    slots into this rank's range, or averaged whole (a tied weight's bucket); nothing to divide after."""

    def __init__(self, params: list[nn.Parameter], comm: Communicator, group: Group, comm_dtype: torch.dtype,
                 whole: frozenset[int], slots: HostSlots) -> None:
        super().__init__(params, comm, group, comm_dtype, whole, storage=slots.mine)
        self.slots: HostSlots = slots

    def launch(self) -> None:
        self.pending = self.slots.all_reduce_mean() if self.averaged.stop is None else self.slots.reduce_scatter_mean()

    complete = HostAllReduceBucket.complete  # wait; the slots' mean needs no division


def host_shard_reduce_bucket(params: list[nn.Parameter], comm: Communicator, group: Group, comm_dtype: torch.dtype,
                             whole: frozenset[int] = frozenset()) -> Bucket:
    """A `HostShardReduceBucket` where its slots can be shared, else a `ShardReduceBucket`."""
    layout = FlatLayout(params, group.size, group.rank)
    slots = open_bucket_slots(params, comm, group, comm_dtype, layout.padded, chunk=layout.size)
    if slots is None:
        return ShardReduceBucket(params, comm, group, comm_dtype, whole)
    return HostShardReduceBucket(params, comm, group, comm_dtype, whole, slots)


class Zero1DataParallel(DistributedDataParallel):
    """`DistributedDataParallel` whose backward leaves the averaged gradient in this rank's range of
    every bucket only (the rest stays local): build `ZeroOptimizer(wrapper, ctx, optimizer_fn)` on it.

    `gradients_sharded` stays False: the gradient is kept whole and accumulates under `no_sync`
    (the pipeline runner relies on that flag to decide whether micro-batches may skip the sync)."""

    def __init__(self, module: nn.Module, ctx: ParallelContext, *, host_slots: bool = False, **options: Any) -> None:
        """`host_slots`: reduce through shared-memory slots where the group's ranks share a host (host_buckets.py)."""
        tied = getattr(module, "tied", None) if ctx.group("pp").size > 1 else None
        whole = frozenset([id(module.get_parameter(tied))] if tied else [])
        kind = host_shard_reduce_bucket if host_slots else ShardReduceBucket
        super().__init__(module, ctx, bucket_kind=functools.partial(kind, whole=whole), **options)
