"""ZeRO stage 2: gradients too are sharded over the data-parallel ranks; parameters are not.

What is split: the optimizer state (as in stage 1, by `ZeroOptimizer` of zero1_optimizer.py) and the
gradient. The trainable parameters are packed into buckets exactly as DDP packs them, by the same
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
- Gradient accumulation: every micro-batch's backward reduce-scatters (there is no `no_sync`), and
  the results are *summed into the shard*. Exact (the sum over micro-batches and ranks of the
  gradients, divided by N), memory stays 4Ψ/N, at the price of k reduce-scatters for k
  micro-batches: k·(N−1)/N·G bytes per step instead of one. (Accumulating locally first would
  need the full 4Ψ gradient between micro-batches: ZeRO-2's memory saving gone.)
- The gradient norm (grad_norm.py: `ZeroOptimizer`'s segments, each parameter weighted by its
  placement; summed over dp_cp, or over the world under tp/pp). The parameter all-gather after the
  step belongs to `ZeroOptimizer`.
- Under tp, a tp-replicated parameter's partial gradient is summed over tp by its tensor hook
  before accumulation (tensor.py), so the shards hold complete gradients; under pp each stage is
  one wrapper, reduce-scattering every micro-batch's backward (the runner never uses `no_sync`),
  and an interleaved pipeline's v chunks are v wrappers (pipeline/chunks.py `DataParallelChunks`:
  one `ZeroOptimizer` over all their buckets), each reduce-scattering in its own backwards.
- zb's split backward: the input-gradient pass I produces no weight gradient (nothing reaches the
  hooks); the weight pass W runs one autograd call per weight operation (split_backward.py), so it
  runs inside `weight_pass()`: the hooks stage each gradient as it is produced and the buckets are
  reduce-scattered when W ends (not overlapped with W's compute), exactly once per micro-batch.

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
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ndtrain.config import ParallelConfig
from ndtrain.mesh import ParallelContext
from ndtrain.parallel.buckets import MB, GradientBuckets, ReduceScatterBucket, broadcast_state
from ndtrain.parallel.flat_layout import Segment
from ndtrain.parallel.pipeline.chunks import DataParallelChunks
from ndtrain.parallel.precision import DTYPES
from ndtrain.parallel.zero1_optimizer import GroupFn, OptimizerFn, ZeroOptimizer, ZeroStrategy, compute_copies

MAX_IN_FLIGHT = 2  # reduce-scatters in flight during backward (bounds the staging memory)


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
        self._grads = GradientBuckets(
            params, ctx.comm, self.group, ReduceScatterBucket, cap_bytes=cap, comm_dtype=comm_dtype,
            max_in_flight=MAX_IN_FLIGHT,
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
    masters = compute_copies(model, DTYPES[cfg.precision])
    chunks = list(model) if isinstance(model, nn.ModuleList) else [model]
    wrappers = [Zero2DataParallel(chunk, ctx, bucket_mb=cfg.bucket_mb, comm_dtype=DTYPES[cfg.comm_dtype]) for chunk in chunks]
    source = wrappers[0] if len(wrappers) == 1 else DataParallelChunks(wrappers)
    optimizer = ZeroOptimizer(source, ctx, optimizer_fn, group_fn=group_fn, masters=masters, sharded=True)
    return ZeroStrategy(source, optimizer, no_sync=contextlib.nullcontext,
                        gradient_bytes=lambda: sum(w.gradient_bytes for w in wrappers), chunks=wrappers)
