"""ZeRO stage 2: gradients too are sharded over the data-parallel ranks; parameters are not.

What is split: the optimizer state (as in stage 1, by `ZeroOptimizer` of zero1_optimizer.py) and the
gradient. The trainable parameters are packed into buckets exactly as DDP packs them (`pack`, in
reverse registration order, at most `bucket_mb` per bucket), each padded to a multiple of N (the
size of `ctx.group("dp_cp")`). Group rank r keeps only the fp32 (float64 for a float64 model) gradient of its slice
[r·s, (r+1)·s) of every bucket (s = padded size / N): the *gradient shard*, which `ZeroOptimizer`
uses as the `.grad` of its segments.

What is communicated, and when:
- At construction, parameters and buffers are broadcast from group rank 0 (as in DDP).
- During every backward, a post-accumulate-grad hook moves each parameter's fresh gradient into
  its bucket's *staging* buffer (allocated at the first gradient of the bucket in this backward,
  in the comm dtype, padding zero) and drops `param.grad`, so autograd's copy is freed at once.
  A complete bucket is reduce-scattered asynchronously into a staging shard while backward goes
  on, strictly in bucket order (every rank issues the same collectives in the same order); at most
  `MAX_IN_FLIGHT` buckets are in flight: launching one more first waits for the oldest, adds its
  result /N into the gradient shard and frees its staging buffers. A callback queued on the
  autograd engine at the first hook launches what is left at the end of backward (a parameter that
  got no gradient counts as zero) and waits for everything.
- Gradient accumulation: every micro-batch's backward reduce-scatters (there is no `no_sync`), and
  the results are *summed into the shard*. Exact (the sum over micro-batches and ranks of the
  gradients, divided by N), memory stays 4Ψ/N, at the price of k reduce-scatters for k
  micro-batches: k·(N−1)/N·G bytes per step instead of one. (Accumulating locally first would
  need the full 4Ψ gradient between micro-batches: ZeRO-2's memory saving gone.)
- The gradient norm (grad_norm.py, over `ZeroOptimizer`'s segments, summed over dp_cp) and the parameter
  all-gather after the step belong to `ZeroOptimizer`.

Cost, Ψ trainable elements, G = Ψ · comm itemsize, N ranks, k micro-batches, ring algorithms:
each rank sends k·(N−1)/N·G (reduce-scatter) + (N−1)/N·Ψ'·param itemsize (all-gather) per step,
1× DDP's volume for k = 1. Memory per rank, fp32: 4Ψ parameters + 4Ψ/N gradient shard + 8Ψ/N
AdamW state; transiently up to MAX_IN_FLIGHT + 1 staging buckets (≤ (MAX_IN_FLIGHT + 1)·bucket_mb)
plus the gradients autograd has produced for the bucket being filled. With bf16/fp16 compute
copies: 2Ψ parameters + 4Ψ/N gradient shard (fp32) + 12Ψ/N (fp32 master + AdamW state).

Limitations: unused parameters count as zero gradients (no error, and weight decay still applies
to them); the parameters must keep being the views `ZeroOptimizer` makes of its flat buffers.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ndtrain.comm import Pending
from ndtrain.mesh import ParallelContext
from ndtrain.parallel.ddp import MB, broadcast_state, pack
from ndtrain.parallel.precision import DTYPES, master_dtype, reduction_dtype
from ndtrain.parallel.zero1_optimizer import GroupFn, OptimizerFn, ZeroOptimizer, ZeroStrategy, compute_copies

MAX_IN_FLIGHT = 2  # reduce-scatters in flight during backward (bounds the staging memory)


class _Bucket:
    """Parameters of one bucket, their offsets, this rank's gradient shard and the in-flight staging."""

    def __init__(self, params: list[nn.Parameter], n: int, rank: int, comm_dtype: torch.dtype) -> None:
        self.params = params
        self.offsets: list[int] = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset
        self.size = -(-offset // n)  # shard elements, padding included
        self.lo = rank * self.size
        self.shard = torch.zeros(self.size, dtype=master_dtype(params[0].dtype), device=params[0].device)
        self.comm_dtype = reduction_dtype(comm_dtype, params[0].dtype)
        self.waiting = len(params)
        self.staging: torch.Tensor | None = None  # [size·N] in the comm dtype, only while in use
        self.received: torch.Tensor | None = None  # [size] reduce-scatter output
        self.pending: Pending | None = None


def _gradient_hook(owner: weakref.ref[Zero2DataParallel], bucket: int, index: int, param: torch.Tensor) -> None:
    wrapper = owner()
    if wrapper is not None:
        wrapper._on_gradient(bucket, index, param)


def _remove_hooks(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()


class Zero2DataParallel(nn.Module):
    """Wrap `module` so that backward leaves this rank's shard of the averaged gradient, nothing more.

    Build `ZeroOptimizer(wrapper, ctx, optimizer_fn)` on it (the optimizer makes the parameters
    views of its flat buffers and all-gathers them after each step). `param.grad` stays None.
    """

    gradients_sharded = True

    def __init__(
        self, module: nn.Module, ctx: ParallelContext, *, bucket_mb: float = 25.0,
        comm_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.module = module
        self.ctx = ctx
        self.group = ctx.group("dp_cp")
        cap = max(1, int(bucket_mb * MB))
        broadcast_state(ctx, self.group, [*module.parameters(), *module.buffers()], cap)
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        n, rank = self.group.size, self.group.rank
        self._buckets = [_Bucket([params[i] for i in run], n, rank, comm_dtype) for run in pack(params, cap)]
        owner = weakref.ref(self)
        handles = []
        for k, bucket in enumerate(self._buckets):
            for i, p in enumerate(bucket.params):
                p.grad = None
                handles.append(p.register_post_accumulate_grad_hook(functools.partial(_gradient_hook, owner, k, i)))
        weakref.finalize(self, _remove_hooks, handles)
        self._callback_queued = False
        self._next_launch = 0
        self._in_flight: list[_Bucket] = []

    # ----------------------------------------------------------------------------- public surface
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def buckets(self) -> tuple[_Bucket, ...]:
        """The buckets in launch order (`params`, `offsets`, `numel`, gradient `shard`)."""
        return tuple(self._buckets)

    def gradient_slice(self, bucket: int, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of bucket `bucket`'s gradient; must lie in this rank's shard."""
        b = self._buckets[bucket]
        assert b.lo <= start <= end <= b.lo + b.size, (bucket, start, end, b.lo, b.size)
        return b.shard[start - b.lo : end - b.lo]

    @property
    def gradient_bytes(self) -> int:
        """Bytes of gradient this rank keeps between steps: the fp32 (or float64) shards."""
        return sum(b.shard.numel() * b.shard.element_size() for b in self._buckets)

    @property
    def reduce_scatter_bytes(self) -> int:
        """Payload of one backward's reduce-scatters (padded buckets in the comm dtype)."""
        return sum(b.size * self.group.size * b.comm_dtype.itemsize for b in self._buckets)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradient shards (they are kept allocated; `set_to_none` is accepted and ignored)."""
        for bucket in self._buckets:
            bucket.shard.zero_()

    # ----------------------------------------------------------------------------- backward
    @torch.no_grad()
    def _on_gradient(self, k: int, index: int, param: torch.Tensor) -> None:
        bucket = self._buckets[k]
        assert param.grad is not None
        staging = self._staging(bucket)
        start = bucket.offsets[index]
        staging[start : start + param.numel()].copy_(param.grad.reshape(-1))
        param.grad = None  # autograd's gradient is freed here; only the staging copy lives on
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True
        bucket.waiting -= 1
        if bucket.waiting == 0:
            self._launch_ready()

    def _staging(self, bucket: _Bucket) -> torch.Tensor:
        if bucket.staging is None:
            bucket.staging = torch.zeros(bucket.size * self.group.size, dtype=bucket.comm_dtype, device=bucket.shard.device)
        return bucket.staging

    def _launch_ready(self) -> None:
        """Launch complete buckets in order, keeping at most MAX_IN_FLIGHT reduce-scatters pending."""
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].waiting == 0:
            bucket = self._buckets[self._next_launch]
            if len(self._in_flight) >= MAX_IN_FLIGHT:
                self._complete(self._in_flight.pop(0))
            bucket.received = torch.empty(bucket.size, dtype=bucket.comm_dtype, device=bucket.shard.device)
            bucket.pending = self.ctx.comm.reduce_scatter(bucket.received, self._staging(bucket), self.group, async_op=True)
            self._in_flight.append(bucket)
            self._next_launch += 1

    def _complete(self, bucket: _Bucket) -> None:
        assert bucket.pending is not None and bucket.received is not None
        bucket.pending.wait()
        bucket.shard.add_(bucket.received, alpha=1.0 / self.group.size)
        bucket.staging = bucket.received = bucket.pending = None

    def _finish(self) -> None:
        """End of backward: launch what is left (missing gradients count as zero), wait for all."""
        for bucket in self._buckets:
            bucket.waiting = 0
        self._launch_ready()
        while self._in_flight:
            self._complete(self._in_flight.pop(0))
        for bucket in self._buckets:
            bucket.waiting = len(bucket.params)
        self._next_launch = 0
        self._callback_queued = False


# ----------------------------------------------------------------------------- data-parallel strategy
def build_zero2(model: nn.Module, ctx: ParallelContext, optimizer_fn: OptimizerFn, group_fn: GroupFn) -> ZeroStrategy:
    """ZeRO-2: `Zero2DataParallel` gradient shards with `ZeroOptimizer`. Every micro-batch's backward
    reduce-scatters into the shard (no `no_sync`), keeping the gradient memory sharded."""
    cfg = ctx.config
    masters = compute_copies(model, DTYPES[cfg.precision])
    wrapper = Zero2DataParallel(model, ctx, bucket_mb=cfg.bucket_mb, comm_dtype=DTYPES[cfg.comm_dtype])
    optimizer = ZeroOptimizer(wrapper, ctx, optimizer_fn, group_fn=group_fn, masters=masters, sharded=True)
    return ZeroStrategy(wrapper, optimizer, no_sync=contextlib.nullcontext, gradient_bytes=lambda: wrapper.gradient_bytes)
