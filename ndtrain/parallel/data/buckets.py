"""Gradient buckets: the one mechanism that synchronises gradients during backward, for DDP and ZeRO-2.

Packing: the parameters given (the wrappers pass the trainable ones in reverse registration order,
about the order backward produces their gradients) are grouped per (dtype, device) into buckets of
at most `cap_bytes` (`pack`; a larger parameter gets a bucket of its own; the very first bucket
may have a smaller cap, `first_cap_bytes`, so that the first collective starts early in backward,
as torch's 1 MB first bucket). Each bucket lays its parameters out flat with a `FlatLayout`
(flat_layout.py) over the N ranks of the group. `arrival` records the order in which the
parameters' gradients were produced in the last synchronising backward, and `reorder(order)`
packs the buckets anew in a given order (DDP's recorded bucket order, ddp.py), carrying the
gradients held over; nothing may be in flight then.

Hooks and launch order: a post-accumulate-grad hook per parameter hands each fresh gradient to its
bucket (`accept`) and, when synchronising, counts it. The first counted hook of a backward queues a
callback on the autograd engine. A bucket whose gradients have all arrived is launched
asynchronously while backward goes on, strictly in bucket order (a complete bucket waits for all
earlier ones), so every rank issues the same collectives in the same order; with `max_in_flight`,
launching one more first completes the oldest (bounding the memory of in-flight buckets). At the
end of backward the callback launches the buckets still waiting (a parameter that got no gradient
counts as zero) and completes all of them in order. With an `on_complete(k)` listener (DDP's flat
optimizer stepping bucket k while later buckets are still on the wire), the hooks also complete,
without blocking, the oldest buckets whose collective has already finished, and every completion
is reported in bucket order. Inside `sync.off()` (the wrappers' `no_sync`) gradients are still
handed to the buckets, but nothing is counted or launched.

The collective is the bucket kind, a parameter of `GradientBuckets`:
- `AllReduceBucket` (DDP): the parameters' `.grad`s are views of one flat buffer of the bucket's B
  bytes, so autograd accumulates straight into it; launch all-reduces it (through a copy in the
  comm dtype when that differs: +B), complete divides by N. Each rank sends 2(N−1)/N·B per bucket.
- `ReduceScatterBucket` (ZeRO-2): each fresh gradient is copied into a staging buffer (comm dtype,
  B' bytes padded to a multiple of N, allocated at the bucket's first gradient of a backward) and
  `.grad` is dropped at once; launch reduce-scatters the staging buffer into a B'/N received
  shard, complete adds received / N into this rank's persistent gradient shard (master dtype:
  fp32, float64 for a float64 model) and frees both. Each rank sends (N−1)/N·B' per bucket and
  holds the shard plus at most max_in_flight + 1 staging buffers. On one CPU host ZeRO-2 uses
  `HostReduceScatterBucket` (zero2_gradients.py): the staging buffer is a shared-memory slot taken
  from a pool of max_in_flight + 1 segments, reduce-scattered through the slots, no received shard.

Nothing autograd holds keeps the owner alive: the hooks reference the `GradientBuckets` weakly and
are removed once it is collected.
"""

from __future__ import annotations

import functools
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ndtrain.dist.comm import Communicator, Group, Pending
from ndtrain.dist.memory import tensor_bytes
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.data.flat_layout import FlatLayout
from ndtrain.parallel.precision import master_dtype, reduction_dtype
from ndtrain.parallel.data.sync_switch import SyncSwitch

MB = 1024 * 1024


def pack(tensors: Sequence[torch.Tensor], cap_bytes: int, first_cap_bytes: int | None = None) -> list[list[int]]:
    """Group the indices of `tensors` per (dtype, device) into runs of at most `cap_bytes`
    (`first_cap_bytes` for the first run, when given).

    Order is kept inside a run and runs are numbered by their first member; a tensor larger than
    the cap is a run of its own.
    """
    runs: list[list[int]] = []
    open_runs: dict[tuple[torch.dtype, torch.device], tuple[int, int]] = {}  # key -> (run, bytes)
    for i, tensor in enumerate(tensors):
        key = (tensor.dtype, tensor.device)
        size = tensor.numel() * tensor.element_size()
        cap = first_cap_bytes if first_cap_bytes is not None and key in open_runs and open_runs[key][0] == 0 else cap_bytes
        if key in open_runs and open_runs[key][1] + size <= cap:
            run, used = open_runs[key]
            runs[run].append(i)
            open_runs[key] = (run, used + size)
        else:
            runs.append([i])
            open_runs[key] = (len(runs) - 1, size)
    return runs


def broadcast_state(ctx: ParallelContext, group: Group, tensors: list[torch.Tensor], cap: int) -> None:
    """Copy group rank 0's values of `tensors` to every rank, in flat chunks of at most `cap` bytes."""
    if group.size == 1:
        return
    for run in pack(tensors, cap):
        chunk = [tensors[i] for i in run]
        flat = torch.cat([t.detach().reshape(-1) for t in chunk])
        ctx.comm.broadcast(flat, group, src=0)
        offset = 0
        with torch.no_grad():
            for t in chunk:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


class Bucket(ABC):
    """The parameters of one bucket, their flat layout over the group, and the collective on it."""

    transient = False  # True: it holds gradient memory only from backward to zero_grad(set_to_none=True)

    def __init__(self, params: list[nn.Parameter], comm: Communicator, group: Group, layout: FlatLayout) -> None:
        self.params, self.communicator, self.group, self.flat_layout = params, comm, group, layout
        self.waiting = len(params)  # gradients still expected in this synchronising backward
        self.pending: Pending | None = None

    @abstractmethod
    def accept(self, index: int, param: nn.Parameter) -> None:
        """Parameter `index` of the bucket has a fresh gradient in `param.grad`."""

    def settle(self) -> None:
        """End of a synchronising backward, before the last launches: fix up missing gradients."""

    @abstractmethod
    def launch(self) -> None:
        """Start the collective asynchronously."""

    @abstractmethod
    def complete(self) -> None:
        """Wait for the collective and fold its result in."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Zero the gradient this bucket keeps between steps."""

    def release(self) -> None:
        """`zero_grad(set_to_none=True)`: the `.grad`s are dropped (a `transient` bucket's memory with them;
        the others keep their buffers)."""
        for param in self.params:
            param.grad = None


class AllReduceBucket(Bucket):
    """DDP: flat gradient storage (`flat`, the `.grad`s are its `views`) averaged over the group."""

    def __init__(self, params: list[nn.Parameter], comm: Communicator, group: Group, comm_dtype: torch.dtype,
                 storage: torch.Tensor | None = None) -> None:
        """`storage`: the zeroed flat buffer to use (a shared-memory slot, host_buckets.py); None: a new one."""
        super().__init__(params, comm, group, FlatLayout(params, 1, 0))
        self.flat = torch.zeros(self.flat_layout.numel, dtype=params[0].dtype, device=params[0].device) if storage is None else storage
        self.views = self.flat_layout.views(self.flat)
        dtype = reduction_dtype(comm_dtype, self.flat.dtype)
        needs_cast = dtype != self.flat.dtype and group.size > 1
        self.comm = torch.empty_like(self.flat, dtype=dtype) if needs_cast else self.flat  # what is all-reduced
        for param, view in zip(params, self.views):
            if param.grad is not None:
                view.copy_(param.grad)
            param.grad = view

    @property
    def comm_bytes(self) -> int:
        return self.comm.numel() * self.comm.element_size()

    def gradient_slice(self, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flat gradient (a view)."""
        return self.flat[start:end]

    def held_bytes(self) -> int:
        """Bytes of gradient this bucket holds now: the flat buffer and its comm-dtype copy."""
        return tensor_bytes(self.flat) + (tensor_bytes(self.comm) if self.comm is not self.flat else 0)

    def accept(self, index: int, param: nn.Parameter) -> None:
        view = self.views[index]
        if param.grad is not view:  # replaced, e.g. after zero_grad(set_to_none=True)
            view.copy_(param.grad)
            param.grad = view

    def settle(self) -> None:
        for param, view in zip(self.params, self.views):
            if param.grad is None:  # no gradient since .grad was dropped: a zero contribution
                view.zero_()
            elif param.grad is not view:  # assigned by the caller
                view.copy_(param.grad)
            param.grad = view

    def launch(self) -> None:
        if self.comm is not self.flat:
            self.comm.copy_(self.flat)
        self.pending = self.communicator.all_reduce(self.comm, self.group, async_op=True)

    def complete(self) -> None:
        assert self.pending is not None
        self.pending.wait()
        self.pending = None
        if self.comm is not self.flat:
            self.flat.copy_(self.comm)
        if self.group.size > 1:
            self.flat.div_(self.group.size)

    def zero_grad(self) -> None:
        self.flat.zero_()
        for param, view in zip(self.params, self.views):
            param.grad = view


class ReduceScatterBucket(Bucket):
    """ZeRO-2: this rank's `shard` of the averaged gradient; `staging`/`received` only while in use."""

    def __init__(self, params: list[nn.Parameter], comm: Communicator, group: Group, comm_dtype: torch.dtype) -> None:
        super().__init__(params, comm, group, FlatLayout(params, group.size, group.rank))
        self.shard = torch.zeros(self.flat_layout.size, dtype=master_dtype(params[0].dtype), device=params[0].device)
        self.comm_dtype = reduction_dtype(comm_dtype, params[0].dtype)
        self.staging: torch.Tensor | None = None  # [padded] in the comm dtype, padding zero
        self.received: torch.Tensor | None = None  # [size]: the reduce-scatter's output
        for param in params:
            param.grad = None

    @property
    def comm_bytes(self) -> int:
        return self.flat_layout.padded * self.comm_dtype.itemsize

    @torch.no_grad()
    def accept(self, index: int, param: nn.Parameter) -> None:
        assert param.grad is not None
        start = self.flat_layout.offsets[index]
        self._staging()[start : start + param.numel()].copy_(param.grad.reshape(-1))
        param.grad = None  # autograd's gradient is freed here; only the staging copy lives on

    def _staging(self) -> torch.Tensor:
        if self.staging is None:
            self.staging = torch.zeros(self.flat_layout.padded, dtype=self.comm_dtype, device=self.shard.device)
        return self.staging

    def launch(self) -> None:
        self.received = torch.empty(self.flat_layout.size, dtype=self.comm_dtype, device=self.shard.device)
        self.pending = self.communicator.reduce_scatter(self.received, self._staging(), self.group, async_op=True)

    def complete(self) -> None:
        assert self.pending is not None and self.received is not None
        self.pending.wait()
        self.shard.add_(self.received, alpha=1.0 / self.group.size)
        self.staging = self.received = self.pending = None

    def zero_grad(self) -> None:
        self.shard.zero_()


BucketKind = Callable[[list[nn.Parameter], Communicator, Group, torch.dtype], Bucket]


def _gradient_hook(owner: weakref.ref[GradientBuckets], index: int, param: nn.Parameter) -> None:
    buckets = owner()
    if buckets is not None:
        buckets._on_gradient(index, param)


def _remove_hooks(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()


class GradientBuckets:
    """`params` packed into buckets of `kind`, synchronised over `group` during every backward.

    `end_of_backward` (default `finish`) is what the queued callback runs: an owner with more to do
    at that point (DDP's unused-parameter check) passes a method of its own, held weakly so that
    dropping the owner frees everything at once, which calls `launch_all()` and `complete_all()`.
    `used[i]` says whether parameter i got a gradient since the last synchronising backward, and
    `arrival` lists the parameter indices in the order their gradients arrived in it.
    `on_complete(k)`, when set, is called after bucket k's collective is complete (in bucket order).
    """

    def __init__(
        self, params: list[nn.Parameter], comm: Communicator, group: Group, kind: BucketKind, *,
        cap_bytes: int, comm_dtype: torch.dtype, max_in_flight: int | None = None,
        end_of_backward: Callable[[], None] | None = None, first_cap_bytes: int | None = None,
    ) -> None:
        self.params = params
        self._pack_args = (comm, group, kind, cap_bytes, comm_dtype, first_cap_bytes)
        self.buckets: list[Bucket] = []
        self._slot: list[tuple[Bucket, int]] = []
        self._pack(list(range(len(params))))
        self.sync = SyncSwitch()
        self.used = [False] * len(params)
        self.arrival: list[int] = []
        self.on_complete: Callable[[int], None] | None = None
        self._max_in_flight = max_in_flight
        self._end_of_backward = None if end_of_backward is None else weakref.WeakMethod(end_of_backward)  # type: ignore[arg-type]
        self._callback_queued = False
        self._next_launch = 0
        self._in_flight: list[int] = []  # indices of launched buckets not completed yet, oldest first
        owner = weakref.ref(self)  # hooks live in autograd's C++ side, where a strong cycle is never collected
        handles = [p.register_post_accumulate_grad_hook(functools.partial(_gradient_hook, owner, i)) for i, p in enumerate(params)]
        weakref.finalize(self, _remove_hooks, handles)

    def _pack(self, order: list[int]) -> None:
        """(Re)build the buckets over the parameters taken in `order` (indices into `params`)."""
        comm, group, kind, cap_bytes, comm_dtype, first_cap_bytes = self._pack_args
        ordered = [self.params[i] for i in order]
        self.buckets = []
        slots: dict[int, tuple[Bucket, int]] = {}
        for run in pack(ordered, cap_bytes, first_cap_bytes):
            bucket = kind([ordered[i] for i in run], comm, group, comm_dtype)
            slots.update((order[i], (bucket, j)) for j, i in enumerate(run))
            self.buckets.append(bucket)
        self._slot = [slots[i] for i in range(len(self.params))]  # parameter index -> (bucket, index in it)

    def reorder(self, order: Sequence[int]) -> None:
        """Pack the buckets anew with the parameters in `order` (a permutation of their indices); the
        gradients they hold are carried into the new buckets. Nothing may be in flight."""
        if self._in_flight or sorted(order) != list(range(len(self.params))):
            raise RuntimeError("reorder needs a permutation of the parameters and no bucket in flight")
        self._pack(list(order))

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.zero_grad()

    def release(self) -> None:
        """Drop every `.grad` (and the memory of buckets that hold gradients only during backward)."""
        for bucket in self.buckets:
            bucket.release()

    def _on_gradient(self, index: int, param: nn.Parameter) -> None:
        bucket, position = self._slot[index]
        bucket.accept(position, param)
        self.used[index] = True
        if not self.sync.enabled:
            return
        if not self._callback_queued:
            callback = None if self._end_of_backward is None else self._end_of_backward()
            torch.autograd.Variable._execution_engine.queue_callback(callback or self.finish)
            self._callback_queued = True
            self.arrival = []
        self.arrival.append(index)
        bucket.waiting -= 1
        if bucket.waiting == 0:
            self._launch_ready()
        if self.on_complete is not None:
            self._complete_finished()

    def _launch_ready(self) -> None:
        """Launch complete buckets in order; a complete bucket waits for all earlier ones."""
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].waiting == 0:
            if self._max_in_flight is not None and len(self._in_flight) >= self._max_in_flight:
                self._complete_oldest()
            bucket = self.buckets[self._next_launch]
            bucket.launch()
            self._in_flight.append(self._next_launch)
            self._next_launch += 1

    def _complete_oldest(self) -> None:
        k = self._in_flight.pop(0)
        self.buckets[k].complete()
        if self.on_complete is not None:
            self.on_complete(k)

    def _complete_finished(self) -> None:
        """Complete, oldest first, the launched buckets whose collective has already finished (no waiting)."""
        while self._in_flight:
            pending = self.buckets[self._in_flight[0]].pending
            if pending is not None and not pending.done():
                return
            self._complete_oldest()

    def launch_all(self) -> None:
        """End of a synchronising backward: launch every bucket not launched yet (missing gradients are zero)."""
        for bucket in self.buckets:
            bucket.settle()
            bucket.waiting = 0
        self._launch_ready()

    def complete_all(self) -> None:
        """Complete every launched bucket in order and reset for the next backward."""
        while self._in_flight:
            self._complete_oldest()
        for bucket in self.buckets:
            bucket.waiting = len(bucket.params)
        self._next_launch = 0
        self.used = [False] * len(self.params)
        self._callback_queued = False

    def finish(self) -> None:
        """The default end of backward: launch what is left, wait for everything."""
        self.launch_all()
        self.complete_all()
