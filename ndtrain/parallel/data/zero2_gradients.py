"""ZeRO stage 2: gradients too are sharded over the data-parallel ranks; parameters are not.

What is split: the optimizer state (as in stage 1, by `ZeroOptimizer` of zero1_optimizer.py, driven
by `ZeroStrategy` of zero_strategy.py) and the gradient. The trainable parameters are packed into buckets exactly as DDP packs them, by the same
bucket layer (buckets.py: `GradientBuckets`, here of `ReduceScatterBucket`s; in reverse
registration order, at most `bucket_mb` per bucket), each laid out flat and padded to a multiple
of N (the size of `ctx.group("dp_cp")`; flat_layout.py). Group rank r keeps only the fp32
(float64 for a float64 model) gradient of its slice [r·s, (r+1)·s) of every bucket
(s = padded size / N): the *gradient shard*, which `ZeroOptimizer` uses as the `.grad` of its
segments, and `segments()` maps back to parameter pieces and their placements.

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
- On one CPU host (`host_slots`, the engine's default there: `parallel.host_shared_memory`), the
  reduce-scatter goes through shared memory instead of gloo's loopback sockets: the wrapper opens
  (collectively, at construction) a `SlotPool` of P = MAX_IN_FLIGHT + 1 segments of N slots, each
  slot the largest bucket's padded size; bucket k takes segment k mod P (`HostReduceScatterBucket`),
  its staging buffer is this rank's slot, zeroed when taken, and `HostSlots.reduce_scatter_mean`
  leaves this rank's range of it averaged, straight out of the other slots ((N−1)/N·B' read, no
  copy, counted as `reduce_scatter_shm`), which completion adds into the shard. Launching in order
  with at most MAX_IN_FLIGHT in flight frees a segment before its next bucket launches; a bucket
  whose gradients come before its turn stages privately and is copied into the slot at launch.
  Where a rank cannot map a segment (another host), every rank keeps gloo's reduce-scatter.
- Gradient accumulation: every micro-batch's backward reduce-scatters (there is no `no_sync`), and
  the results are *summed into the shard*. Exact (the sum over micro-batches and ranks of the
  gradients, divided by N), memory stays 4Ψ/N, at the price of k reduce-scatters for k
  micro-batches: k·(N−1)/N·G bytes per step instead of one. (Accumulating locally first would
  need the full 4Ψ gradient between micro-batches: ZeRO-2's memory saving gone.)
- The gradient norm (parallel/grad_norm.py: `ZeroOptimizer`'s segments, each parameter weighted by its
  placement; summed over dp_cp, or over the world under tp/pp). The parameter all-gather after the
  step belongs to `ZeroOptimizer`.
- Under tp, a tp-replicated parameter's partial gradient is summed over tp by its tensor hook
  before accumulation (parallel/model/tensor.py), so the shards hold complete gradients; under pp each stage is
  one wrapper, reduce-scattering every micro-batch's backward (its `StageHooks` have no `no_sync`),
  and an interleaved pipeline's v chunks are v wrappers (chunks.py `DataParallelChunks`:
  one `ZeroOptimizer` over all their buckets), each reduce-scattering in its own backwards.
- zb's split backward: the input-gradient pass I produces no weight gradient (nothing reaches the
  hooks); the weight pass W runs one autograd call per weight operation (pipeline/split_backward.py),
  so it runs inside `weight_pass()` (the chunk's `StageHooks.weight_pass`): the hooks stage each
  gradient as it is produced and the buckets are reduce-scattered when W ends (not overlapped with
  W's compute), exactly once per micro-batch (through the slots: the first P buckets staged in their
  slots, the others privately).

Cost, Ψ trainable elements, G = Ψ · comm itemsize, N ranks, k micro-batches, ring algorithms:
each rank sends k·(N−1)/N·G (reduce-scatter) + (N−1)/N·Ψ'·param itemsize (all-gather) per step,
1× DDP's volume for k = 1. Memory per rank, fp32: 4Ψ parameters + 4Ψ/N gradient shard + 8Ψ/N
AdamW state; transiently up to MAX_IN_FLIGHT + 1 staging buckets (≤ (MAX_IN_FLIGHT + 1)·bucket_mb)
plus the gradients autograd has produced for the bucket being filled. Through the slots the
staging buffers of the P buckets holding a segment are the segment's pages: (MAX_IN_FLIGHT + 1)·B'max
of shared memory per rank for as long as the wrapper lives (B'max: the largest padded bucket),
plus, per segment, the (N−1)/N·B'max of the others' slots a rank reads, counted in its resident
set too (shared pages, not copies); private staging only for a bucket staged before its turn.
With bf16/fp16 compute copies: 2Ψ parameters + 4Ψ/N gradient shard (fp32) + 12Ψ/N (fp32 master + AdamW state).

Limitations: unused parameters count as zero gradients (no error, and weight decay still applies
to them); the parameters must keep being the views `ZeroOptimizer` makes of its flat buffers.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ndtrain.dist.comm import Communicator, Group
from ndtrain.config import ParallelConfig
from ndtrain.dist.host_slots import HostSlots
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.data.buckets import MB, GradientBuckets, ReduceScatterBucket, broadcast_state, pack
from ndtrain.parallel.data.flat_layout import FlatLayout, Segment
from ndtrain.parallel.data.chunks import DataParallelChunks
from ndtrain.parallel.data.host_buckets import open_bucket_slots
from ndtrain.parallel.data.param_groups import GroupFn, OptimizerFn
from ndtrain.parallel.data.zero1_optimizer import ZeroOptimizer
from ndtrain.parallel.data.zero_strategy import ZeroStrategy, cast_to_compute
from ndtrain.parallel.pipeline.hooks import StageHooks
from ndtrain.parallel.precision import DTYPES

MAX_IN_FLIGHT = 2  # reduce-scatters in flight during backward (bounds the staging memory)


class SlotPool:
    """Shared-memory segments (dist/host_slots.py) that the buckets take turns on: bucket k on segment k mod P.

    A bucket holds its segment from its first gradient (or its launch) to its completion. Bucket k's
    turn on segment s = k mod P comes once bucket k − P has released it in this backward (the first
    P buckets: once the last user of the previous backward has, as every backward completes all)."""

    def __init__(self, segments: list[HostSlots]) -> None:
        self.segments = segments
        self._holder: list[int | None] = [None] * len(segments)  # the bucket holding each segment
        self._turn = list(range(len(segments)))  # the bucket whose turn each segment is in this backward
        self._enlisted = 0

    @staticmethod
    def open(params: list[nn.Parameter], comm: Communicator, group: Group, comm_dtype: torch.dtype, cap: int) -> SlotPool | None:
        """Collective: MAX_IN_FLIGHT + 1 segments (fewer when there are fewer buckets) of the largest
        bucket's padded size, or None on every rank where the backend must reduce-scatter (see
        `open_bucket_slots`; also parameters of several dtypes)."""
        if not params or len({p.dtype for p in params}) > 1:
            return None
        runs = pack(params, cap)
        numel = max(FlatLayout([params[i] for i in run], group.size, group.rank).padded for run in runs)
        segments = []
        for _ in range(min(MAX_IN_FLIGHT + 1, len(runs))):
            slots = open_bucket_slots(params, comm, group, comm_dtype, numel)
            if slots is None:  # decided alike on every rank
                return None
            segments.append(slots)
        return SlotPool(segments)

    def enlist(self) -> int:
        """The index of a new bucket (buckets enlist in bucket order)."""
        self._enlisted += 1
        return self._enlisted - 1

    def free_for(self, bucket: int) -> bool:
        s = bucket % len(self.segments)
        return self._holder[s] is None and (bucket < len(self.segments) or self._turn[s] == bucket)

    def take(self, bucket: int) -> None:
        s = bucket % len(self.segments)
        assert self.free_for(bucket), f"bucket {bucket}'s segment: held by bucket {self._holder[s]}, turn of {self._turn[s]}"
        self._holder[s] = bucket

    def release(self, bucket: int) -> None:
        s = bucket % len(self.segments)
        assert self._holder[s] == bucket, (bucket, self._holder[s])
        self._holder[s], self._turn[s] = None, bucket + len(self.segments)


class HostReduceScatterBucket(ReduceScatterBucket):
    """A ZeRO-2 bucket staged in this rank's slot of a pool segment and reduce-scattered through the
    slots (`HostSlots.reduce_scatter_mean`: this rank's range of its slot becomes the mean, added to
    the shard at completion). A bucket whose first gradient comes before its turn on the segment
    (gradients out of bucket order, or zb's weight pass staging every bucket) stages in a private
    buffer as `ReduceScatterBucket` does and copies it into the slot at launch: by then the buckets
    before it on the segment are complete (launch order, at most MAX_IN_FLIGHT in flight)."""

    def __init__(self, params: list[nn.Parameter], comm: Communicator, group: Group, comm_dtype: torch.dtype,
                 pool: SlotPool) -> None:
        super().__init__(params, comm, group, comm_dtype)
        self.pool, self.index = pool, pool.enlist()
        self.segment = pool.segments[self.index % len(pool.segments)].cut(self.flat_layout.padded, self.flat_layout.size)
        self._holding = False

    def _staging(self) -> torch.Tensor:
        if self.staging is None and self.pool.free_for(self.index):
            self._take()
            self.staging = self.segment.mine.zero_()
        return super()._staging()

    def _take(self) -> None:
        self.pool.take(self.index)
        self._holding = True

    def launch(self) -> None:
        staging = self._staging()
        if not self._holding:  # staged privately
            self._take()
            self.segment.mine.copy_(staging)
        self.pending = self.segment.reduce_scatter_mean()

    def complete(self) -> None:
        assert self.pending is not None and self._holding
        self.pending.wait()
        lo, hi = self.segment.chunks[self.group.rank]
        self.shard.add_(self.segment.mine[lo:hi])  # already divided by N
        self.pool.release(self.index)
        self.staging = self.pending = None
        self._holding = False


class Zero2DataParallel(nn.Module):
    """Wrap `module` so that backward leaves this rank's shard of the averaged gradient, nothing more.

    Build `ZeroOptimizer(wrapper, ctx, optimizer_fn)` on it (the optimizer makes the parameters
    views of its flat buffers and all-gathers them after each step). `param.grad` stays None.
    """

    gradients_sharded = True

    def __init__(
        self, module: nn.Module, ctx: ParallelContext, *, bucket_mb: float = 25.0,
        comm_dtype: torch.dtype = torch.float32, host_slots: bool = False,
    ) -> None:
        """`host_slots`: reduce-scatter through a pool of shared-memory segments where the group's
        ranks share a host (`SlotPool`, `HostReduceScatterBucket`)."""
        super().__init__()
        self.module = module
        self.ctx = ctx
        self.group = ctx.group("dp_cp")
        cap = max(1, int(bucket_mb * MB))
        broadcast_state(ctx, self.group, [*module.parameters(), *module.buffers()], cap)
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        pool = SlotPool.open(params, ctx.comm, self.group, comm_dtype, cap) if host_slots else None
        kind = ReduceScatterBucket if pool is None else functools.partial(HostReduceScatterBucket, pool=pool)
        self._grads = GradientBuckets(
            params, ctx.comm, self.group, kind, cap_bytes=cap, comm_dtype=comm_dtype, max_in_flight=MAX_IN_FLIGHT,
        )
        self._buckets: list[ReduceScatterBucket] = self._grads.buckets  # type: ignore[assignment]

    # ----------------------------------------------------------------------------- public surface
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def buckets(self) -> tuple[ReduceScatterBucket, ...]:
        """The buckets in launch order (`params`, `flat_layout`, gradient `shard`)."""
        return tuple(self._buckets)

    def gradient_slice(self, bucket: int, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of bucket `bucket`'s gradient; must lie in this rank's shard."""
        b = self._buckets[bucket]
        lo, hi = b.flat_layout.lo, b.flat_layout.hi
        assert lo <= start <= end <= hi, (bucket, start, end, lo, hi)
        return b.shard[start - lo : end - lo]

    def segments(self) -> list[Segment]:
        """Each parameter piece of this rank's gradient shards (placement, local shape, [start, stop)
        in the parameter, a view of the shard), bucket by bucket."""
        return [segment for b in self._buckets for segment in b.flat_layout.segments(b.shard)]

    def grad_segments(self) -> list[Segment]:
        """`segments()`, under the name every gradient-sharding wrapper gives them (pipeline/tied_shards.py)."""
        return self.segments()

    @property
    def gradient_bytes(self) -> int:
        """Bytes of gradient this rank keeps between steps: the fp32 (or float64) shards."""
        return sum(b.shard.numel() * b.shard.element_size() for b in self._buckets)

    @property
    def reduce_scatter_bytes(self) -> int:
        """Payload of one backward's reduce-scatters (padded buckets in the comm dtype)."""
        return sum(b.comm_bytes for b in self._buckets)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradient shards (they are kept allocated; `set_to_none` is accepted and ignored)."""
        self._grads.zero_grad()

    @contextlib.contextmanager
    def weight_pass(self) -> Iterator[None]:
        """Several autograd calls that together are one backward (zb's weight pass W): the gradients
        they produce are staged as usual, and every bucket is reduce-scattered once, when W ends."""
        with self._grads.sync.off():
            yield None
        self._grads.finish()


# ----------------------------------------------------------------------------- data-parallel strategy
def build_zero2(model: nn.Module, ctx: ParallelContext, cfg: ParallelConfig, optimizer_fn: OptimizerFn, group_fn: GroupFn) -> ZeroStrategy:
    """ZeRO-2: `Zero2DataParallel` gradient shards with `ZeroOptimizer` (one wrapper per chunk of an
    interleaved pipeline, one optimizer over all). Every micro-batch's backward reduce-scatters into
    the shard (no `no_sync`), keeping the gradient memory sharded."""
    masters = cast_to_compute(model, DTYPES[cfg.precision])
    chunks = list(model) if isinstance(model, nn.ModuleList) else [model]
    wrappers = [Zero2DataParallel(chunk, ctx, bucket_mb=cfg.bucket_mb, comm_dtype=DTYPES[cfg.comm_dtype],
                                  host_slots=cfg.host_shared_memory) for chunk in chunks]
    source = wrappers[0] if len(wrappers) == 1 else DataParallelChunks(wrappers)
    optimizer = ZeroOptimizer(source, ctx, optimizer_fn, group_fn=group_fn, masters=masters, sharded=True)
    return ZeroStrategy(source, optimizer, no_sync=contextlib.nullcontext,
                        gradient_bytes=lambda: sum(w.gradient_bytes for w in wrappers), chunks=wrappers,
                        stage_hooks=[StageHooks(gradients_sharded=True, weight_pass=lambda w=w: w.weight_pass())
                                     for w in wrappers])
