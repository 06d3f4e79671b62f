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
bucket; NCCL reduce-scatters in place at (N−1)/N·G.

On one CPU host (`host_slots`, the engine's default there) the buckets are `HostShardReduceBucket`s
and hold no flat gradient: the gradients stay autograd's own `.grad`s, made during backward, and a
complete bucket is reduce-scattered through the wrapper's `SlotRing` (dist/host_stream.py: two
shared-memory segments of a few MB taken in turn by rounds of 2^18 elements of every rank's range;
(N−1)/N·G read between the processes, no socket, no kernel copy) into `shard`, this rank's averaged
range (4Ψ'/N), which the optimizer reads; `ZeroOptimizer` then gathers the updated parameters
through the same ring. `zero_grad(set_to_none=True)` (what the engine calls at every step) drops
the `.grad`s and the shard: between steps, and in the forward pass where activations peak, the
gradient holds no memory, where a persistent bucket holds 4Ψ' (torch's DDP with gradient views).
Memory then: 4Ψ'/N shard from the reduction to `zero_grad`, the `.grad`s (4Ψ) from backward to
`zero_grad`, the ring's 2·N·2^18 elements of shared pages. The bucket of a pipeline-tied weight,
which the runner needs averaged whole, is a backend `ShardReduceBucket` (all-reduced).
"""

from __future__ import annotations

import bisect
import functools
from typing import Any

import torch
from torch import nn

from ndtrain.dist.comm import Communicator, Group
from ndtrain.dist.host_stream import SlotRing
from ndtrain.dist.memory import tensor_bytes
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.data.buckets import AllReduceBucket, Bucket
from ndtrain.parallel.data.ddp import DistributedDataParallel
from ndtrain.parallel.data.flat_layout import FlatLayout
from ndtrain.parallel.precision import reduction_dtype


class ShardReduceBucket(AllReduceBucket):
    """A DDP bucket (full `flat` gradient, `.grad`s are its `views`) padded to a multiple of N and
    reduce-scattered in place: after `complete()` only this rank's range [lo, hi) is averaged.
    A bucket holding a parameter of `whole` (a pipeline-tied weight, whose two copies the pipeline
    runner sums whole after backward) is all-reduced instead, as DDP does."""

    def __init__(self, params: list[nn.Parameter], comm: Communicator, group: Group, comm_dtype: torch.dtype,
                 whole: frozenset[int] = frozenset()) -> None:
        Bucket.__init__(self, params, comm, group, FlatLayout(params, group.size, group.rank))
        self.flat = torch.zeros(self.flat_layout.padded, dtype=params[0].dtype, device=params[0].device)
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


class HostShardReduceBucket(Bucket):
    """A ZeRO-1 bucket on one CPU host: the gradients stay autograd's own per-parameter `.grad`s (made
    during backward, accumulated in place under `no_sync`), and the mean of this rank's range [lo, hi)
    of the bucket's flat layout is reduced through the wrapper's `SlotRing` (dist/host_stream.py) into
    `shard` (s elements, the gradient the optimizer reads, made at the reduction). `release()`
    (`zero_grad(set_to_none=True)`) drops both, so a forward pass after it holds no gradient."""

    transient = True

    def __init__(self, params: list[nn.Parameter], comm: Communicator, group: Group, ring: SlotRing) -> None:
        super().__init__(params, comm, group, FlatLayout(params, group.size, group.rank))
        self.ring = ring
        self.shard: torch.Tensor | None = None

    @property
    def comm_bytes(self) -> int:
        return self.flat_layout.padded * self.params[0].element_size()

    def _shard(self, zeroed: bool = True) -> torch.Tensor:
        """The averaged range's buffer (made now if released; `zeroed=False`: a reduction will fill it)."""
        if self.shard is None:
            first = self.params[0]
            make = torch.zeros if zeroed else torch.empty
            self.shard = make(self.flat_layout.size, dtype=first.dtype, device=first.device)
        return self.shard

    def gradient_slice(self, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the averaged gradient; must lie in this rank's range (zeros before a reduction)."""
        lo, hi = self.flat_layout.lo, self.flat_layout.hi
        assert lo <= start <= end <= hi, (start, end, lo, hi)
        return self._shard()[start - lo : end - lo]

    def held_bytes(self) -> int:
        shard = 0 if self.shard is None else tensor_bytes(self.shard)
        return shard + sum(tensor_bytes(p.grad) for p in self.params if p.grad is not None)

    def accept(self, index: int, param: nn.Parameter) -> None:
        """Nothing to move: the gradient is read from `.grad` when the bucket is reduced."""

    def launch(self) -> None:
        self.pending = self.ring.reduce_scatter_mean(self._read, self._shard(zeroed=False), self.flat_layout.size)  # type: ignore[assignment]

    def complete(self) -> None:
        assert self.pending is not None
        self.pending.wait()
        self.pending = None

    def zero_grad(self) -> None:
        for param in self.params:
            if param.grad is not None:
                param.grad.zero_()

    def release(self) -> None:
        super().release()
        self.shard = None

    def _read(self, offset: int, into: torch.Tensor) -> None:
        """Elements [offset, offset + len(into)) of the bucket's flat gradient into `into` (zero where a
        parameter has no gradient, and in the padding)."""
        end = offset + into.numel()
        covered = offset
        offsets = self.flat_layout.offsets
        for i in range(max(0, bisect.bisect_right(offsets, offset) - 1), len(self.params)):
            param, start = self.params[i], offsets[i]
            if start >= end:
                break
            lo, hi = max(offset, start), min(end, start + param.numel())
            if lo >= hi:
                continue
            target = into[lo - offset : hi - offset]
            if param.grad is None:
                target.zero_()
            else:
                target.copy_(param.grad.reshape(-1)[lo - start : hi - start])
            covered = hi
        if covered < end:
            into[covered - offset :].zero_()


def host_shard_reduce_bucket(params: list[nn.Parameter], comm: Communicator, group: Group, comm_dtype: torch.dtype,
                             whole: frozenset[int] = frozenset(), ring: SlotRing | None = None) -> Bucket:
    """A `HostShardReduceBucket` where `ring` carries the bucket's dtype (and it holds no pipeline-tied
    weight, which the runner needs averaged whole), else a `ShardReduceBucket` (the backend's collectives)."""
    if ring is None or ring.dtype != params[0].dtype or any(id(p) in whole for p in params):
        return ShardReduceBucket(params, comm, group, comm_dtype, whole)
    return HostShardReduceBucket(params, comm, group, ring)


class Zero1DataParallel(DistributedDataParallel):
    """`DistributedDataParallel` whose backward leaves the averaged gradient in this rank's range of
    every bucket only (the rest stays local): build `ZeroOptimizer(wrapper, ctx, optimizer_fn)` on it.

    `gradients_sharded` stays False: the gradient is kept whole and accumulates under `no_sync`
    (the pipeline runner relies on that flag to decide whether micro-batches may skip the sync)."""

    def __init__(self, module: nn.Module, ctx: ParallelContext, *, host_slots: bool = False, **options: Any) -> None:
        """`host_slots`: reduce through a ring of shared-memory segments where the group's ranks share a
        CPU host and the comm dtype is the gradients' (dist/host_stream.py; opening it is collective)."""
        tied = getattr(module, "tied", None) if ctx.group("pp").size > 1 else None
        whole = frozenset([id(module.get_parameter(tied))] if tied else [])
        trainable = [p for p in module.parameters() if p.requires_grad]
        group = ctx.group("dp_cp")
        ring = None
        dtype = trainable[0].dtype if trainable else None
        if (host_slots and dtype is not None and trainable[0].device.type == "cpu" and group.size > 1
                and reduction_dtype(options.get("comm_dtype", torch.float32), dtype) == dtype):
            ring = SlotRing.open(ctx.comm, group, dtype)  # collective: a ring, or None on every rank
        kind = ShardReduceBucket if ring is None else functools.partial(host_shard_reduce_bucket, ring=ring)
        super().__init__(module, ctx, bucket_kind=functools.partial(kind, whole=whole), **options)
