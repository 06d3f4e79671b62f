"""Distributed data parallel: every rank holds the whole model and averages gradients during backward.

What is split: the batch. Each of the N ranks of the `dp_cp` group runs forward and backward on
its own part of the global batch; after `loss.backward()` every rank holds the same gradient, the
mean over the N ranks, so `optimizer.step()` keeps the replicas identical.

What is communicated, and when:
- At construction, parameters and buffers are broadcast from group rank 0 (flattened per dtype
  into chunks of at most one bucket), so ranks that initialised differently start equal.
  Buffers are not synchronised again (no running statistics are averaged).
- During each synchronising backward, gradients are all-reduced in buckets. The parameters that
  require grad, in reverse registration order (about the order backward produces them), are
  packed per dtype and device into flat buffers of at most `bucket_mb` (a larger parameter gets
  a bucket of its own). Each `param.grad` is a view into its bucket, so autograd accumulates
  straight into it. A post-accumulate-grad hook counts the gradients of each bucket; a complete
  bucket is all-reduced asynchronously while backward goes on, strictly in bucket order, so every
  rank issues the same collectives in the same order. The first hook of a backward queues a
  callback on the autograd engine that, at the end of backward, launches the buckets still
  waiting, waits for all of them and divides by N.
- Inside `no_sync()` nothing is communicated: gradients accumulate locally in the buckets and the
  next synchronising backward reduces the sum.
- Unused parameters are looked for on the first synchronising backward (an error unless
  `allow_unused`). With `allow_unused` their slices count as zero, every bucket is still reduced,
  and one flag per parameter is all-reduced (max) so that a parameter no rank used keeps
  `.grad = None`, as in the single-process model.

Cost per synchronising step, with G the gradient bytes on the wire (Σ numel · itemsize of the
trainable parameters in the comm dtype) and the ring algorithm: each rank sends 2(N−1)/N · G bytes
in about G / bucket_mb calls (+ P bytes, P parameters, with `allow_unused`). Memory: the
gradients live in the buckets, no extra copy; a comm dtype other than the parameters' (bf16)
adds one buffer per bucket, G bytes in total. The fp32 comm dtype reduces float64 parameters'
gradients in float64 (`reduction_dtype`), so a float64 model is never narrowed.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from ndtrain.comm import Group, Pending
from ndtrain.errors import UserError
from ndtrain.mesh import ParallelContext
from ndtrain.memory import optimizer_state_bytes, tensor_bytes
from ndtrain.parallel.grad_norm import GradPiece, optimizer_param_grads, whole_pieces
from ndtrain.parallel.precision import DTYPES, reduction_dtype

MB = 1024 * 1024


def pack(tensors: Sequence[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """Group the indices of `tensors` per (dtype, device) into runs of at most `cap_bytes`.

    Order is kept inside a run and runs are numbered by their first member; a tensor larger than
    the cap is a run of its own.
    """
    runs: list[list[int]] = []
    open_runs: dict[tuple[torch.dtype, torch.device], tuple[int, int]] = {}  # key -> (run, bytes)
    for i, tensor in enumerate(tensors):
        key = (tensor.dtype, tensor.device)
        size = tensor.numel() * tensor.element_size()
        if key in open_runs and open_runs[key][1] + size <= cap_bytes:
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


def _gradient_hook(owner: weakref.ref[DistributedDataParallel], index: int, param: torch.Tensor) -> None:
    ddp = owner()
    if ddp is not None:
        ddp._on_gradient(index, param)


def _remove_hooks(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()


class _Bucket:
    """Flat gradient storage of some parameters, and what is all-reduced for it."""

    def __init__(self, params: list[nn.Parameter], comm_dtype: torch.dtype, group_size: int) -> None:
        self.params = params
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        comm_dtype = reduction_dtype(comm_dtype, self.flat.dtype)
        needs_cast = comm_dtype != self.flat.dtype and group_size > 1
        self.comm = torch.empty_like(self.flat, dtype=comm_dtype) if needs_cast else self.flat
        self.waiting = len(params)  # hooks still expected in this synchronising backward
        self.pending: Pending | None = None

    @property
    def comm_bytes(self) -> int:
        return self.comm.numel() * self.comm.element_size()


class DistributedDataParallel(nn.Module):
    """Wrap `module` so that `loss.backward()` leaves the gradient averaged over `ctx.group("dp_cp")`.

    The hooks hold the wrapper weakly; once it is dropped they are removed (the module's `.grad`s
    stay views of the old buckets until replaced).
    """

    def __init__(
        self, module: nn.Module, ctx: ParallelContext, *, bucket_mb: float = 25.0,
        comm_dtype: torch.dtype = torch.float32, allow_unused: bool = False,
    ) -> None:
        super().__init__()
        self.module = module
        self.ctx = ctx
        self.group = ctx.group("dp_cp")
        self.allow_unused = allow_unused
        cap = max(1, int(bucket_mb * MB))
        broadcast_state(ctx, self.group, [*module.parameters(), *module.buffers()], cap)

        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        named.reverse()
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._buckets: list[_Bucket] = []
        slots: dict[int, tuple[_Bucket, torch.Tensor]] = {}
        for run in pack(self._params, cap):
            bucket = _Bucket([self._params[i] for i in run], comm_dtype, self.group.size)
            self._buckets.append(bucket)
            slots.update((i, (bucket, view)) for i, view in zip(run, bucket.views))
        self._slot = [slots[i] for i in range(len(self._params))]  # parameter index -> (bucket, grad view)
        owner = weakref.ref(self)  # hooks live in autograd's C++ side, where a strong cycle is never collected
        handles = []
        for i, (param, (_, view)) in enumerate(zip(self._params, self._slot)):
            if param.grad is not None:
                view.copy_(param.grad)
            param.grad = view
            handles.append(param.register_post_accumulate_grad_hook(functools.partial(_gradient_hook, owner, i)))
        weakref.finalize(self, _remove_hooks, handles)

        self._sync = True
        self._callback_queued = False
        self._next_launch = 0
        self._used = [False] * len(self._params)
        self._checked_unused = allow_unused

    # ----------------------------------------------------------------------------- public surface
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def buckets(self) -> tuple["_Bucket", ...]:
        """The gradient buckets in launch order (their `params`, `flat` storage and per-parameter `views`)."""
        return tuple(self._buckets)

    gradients_sharded = False  # every rank holds the whole averaged gradient (see zero.GradientSource)

    def gradient_slice(self, bucket: int, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of gradient bucket `bucket` (a view)."""
        return self._buckets[bucket].flat[start:end]

    @property
    def bucket_count(self) -> int:
        return len(self._buckets)

    @property
    def bucket_bytes(self) -> list[int]:
        """Bytes all-reduced per bucket, in launch order."""
        return [b.comm_bytes for b in self._buckets]

    @property
    def gradient_bytes(self) -> int:
        """Bytes of all-reduced gradient payload per synchronising step (the G of the docstring)."""
        return sum(self.bucket_bytes)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside reduces the sum."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the buckets in place, keeping every `.grad` a bucket view (`set_to_none` drops them)."""
        if set_to_none:
            super().zero_grad(set_to_none=True)
            return
        for bucket in self._buckets:
            bucket.flat.zero_()
        for param, (_, view) in zip(self._params, self._slot):
            param.grad = view

    # ----------------------------------------------------------------------------- backward
    def _on_gradient(self, index: int, param: torch.Tensor) -> None:
        bucket, view = self._slot[index]
        if param.grad is not view:  # replaced, e.g. after zero_grad(set_to_none=True)
            view.copy_(param.grad)
            param.grad = view
        self._used[index] = True
        if not self._sync:
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_sync)
            self._callback_queued = True
        bucket.waiting -= 1
        if bucket.waiting == 0:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch complete buckets in order; a complete bucket waits for all earlier ones."""
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].waiting == 0:
            bucket = self._buckets[self._next_launch]
            if bucket.comm is not bucket.flat:
                bucket.comm.copy_(bucket.flat)
            bucket.pending = self.ctx.comm.all_reduce(bucket.comm, self.group, async_op=True)
            self._next_launch += 1

    def _finish_sync(self) -> None:
        """End of a synchronising backward: reduce whatever is left, wait, average."""
        for param, (_, view) in zip(self._params, self._slot):
            if param.grad is None:  # no gradient since .grad was dropped: a zero contribution
                view.zero_()
            elif param.grad is not view:  # assigned by the caller
                view.copy_(param.grad)
            param.grad = view
        error = self._first_unused_check()
        for bucket in self._buckets:
            bucket.waiting = 0
        self._launch_ready()
        usage = self._launch_usage() if self.allow_unused else None
        for bucket in self._buckets:
            assert bucket.pending is not None
            bucket.pending.wait()
            bucket.pending = None
            if bucket.comm is not bucket.flat:
                bucket.flat.copy_(bucket.comm)
            if self.group.size > 1:
                bucket.flat.div_(self.group.size)
        if usage is not None:
            used_anywhere, pending = usage
            pending.wait()
            for param, used in zip(self._params, used_anywhere.tolist()):
                if not used:  # no rank produced a gradient: keep .grad None, as without DDP
                    param.grad = None
        for bucket in self._buckets:
            bucket.waiting = len(bucket.params)
        self._next_launch = 0
        self._used = [False] * len(self._params)
        self._callback_queued = False
        if error is not None:
            raise error

    def _launch_usage(self) -> tuple[torch.Tensor, Pending]:
        """One flag per parameter, max-reduced: was it used on any rank since the last sync?"""
        flags = torch.tensor(self._used, dtype=torch.uint8, device=self._buckets[0].flat.device)
        pending = self.ctx.comm.all_reduce(flags, self.group, op=dist.ReduceOp.MAX, async_op=True)
        assert pending is not None
        return flags, pending

    def _first_unused_check(self) -> UserError | None:
        """On the first synchronising backward (without allow_unused): the error naming unused parameters."""
        if self._checked_unused:
            return None
        self._checked_unused = True
        unused = [name for name, used in zip(self._names, self._used) if not used]
        if not unused:
            return None
        return UserError(
            f"parameters received no gradient: {', '.join(reversed(unused))}; "
            "set parallel.allow_unused_params=true if that is intended"
        )


# ----------------------------------------------------------------------------- data-parallel strategy (ZeRO-0)
def ddp_chunks(model: nn.Module, ctx: ParallelContext) -> list[DistributedDataParallel]:
    """`model` wrapped in DDP as configured (`ctx.config`): one wrapper, or one per chunk of an
    interleaved pipeline (a ModuleList of stage chunks, each with its own buckets)."""
    cfg = ctx.config
    comm_dtype = DTYPES[cfg.comm_dtype]
    if isinstance(model, nn.ModuleList):
        return [DistributedDataParallel(chunk, ctx, bucket_mb=cfg.bucket_mb, comm_dtype=comm_dtype) for chunk in model]
    return [DistributedDataParallel(model, ctx, bucket_mb=cfg.bucket_mb, comm_dtype=comm_dtype,
                                    allow_unused=cfg.allow_unused_params)]


def held_gradient_bytes(chunks: Sequence[DistributedDataParallel]) -> int:
    """Bytes of gradient the wrappers hold: their buckets, plus the comm-dtype copies."""
    return sum(tensor_bytes(b.flat) + (tensor_bytes(b.comm) if b.comm is not b.flat else 0)
               for chunk in chunks for b in chunk.buckets)


class DDPStrategy:
    """ZeRO-0 in fp32 (`data_parallel.DataParallelStrategy`): DDP wrappers (one, or one per interleaved
    pipeline chunk) and the caller's optimizer over the whole model. Gradients are replicated, so the
    norm's pieces are whole `.grad`s, summed over mp only; checkpoints need no per-rank optimizer state."""

    grads_sharded = False
    shards_optimizer = False
    sharded_model = None
    weights_are_masters = True
    forward_communicates = False

    def __init__(self, chunks: list[DistributedDataParallel], optimizer: torch.optim.Optimizer, ctx: ParallelContext) -> None:
        self.chunks: list[nn.Module] = list(chunks)
        self.module: nn.Module = chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)
        self.optimizer = optimizer
        self._tp = ctx.group("tp").size

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for chunk in self.chunks:
                stack.enter_context(chunk.no_sync())
            yield

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad()

    def optimizer_grads(self) -> list[torch.Tensor]:
        return optimizer_param_grads(self.optimizer)

    def grad_pieces(self) -> list[GradPiece]:
        return whole_pieces((p for g in self.optimizer.param_groups for p in g["params"]), self._tp)

    def state_bytes(self) -> dict[str, int]:
        return {"parameters": sum(tensor_bytes(p) for p in self.module.parameters()),
                "gradients": held_gradient_bytes(self.chunks), "optimizer": optimizer_state_bytes(self.optimizer)}
