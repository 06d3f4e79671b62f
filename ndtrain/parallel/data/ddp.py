"""Distributed data parallel: every rank holds the whole model and averages gradients during backward.

What is split: the batch. Each of the N ranks of the `dp_cp` group runs forward and backward on
its own part of the global batch; after `loss.backward()` every rank holds the same gradient, the
mean over the N ranks, so `optimizer.step()` keeps the replicas identical.

What is communicated, and when:
- At construction, parameters and buffers are broadcast from group rank 0 (flattened per dtype
  into chunks of at most one bucket), so ranks that initialised differently start equal.
  Buffers are not synchronised again (no running statistics are averaged).
- During each synchronising backward, gradients are all-reduced in buckets, by the bucket layer
  (buckets.py: `GradientBuckets` of `AllReduceBucket`s; with `host_slots`, on a CPU group whose
  ranks share a host, `HostAllReduceBucket`s that live in shared memory and are averaged by the
  ranks reading each other's slots, host_buckets.py). The parameters that require grad, in
  reverse registration order (about the order backward produces them), are packed per dtype and
  device into flat buffers of at most `bucket_mb` (a larger parameter gets a bucket of its own;
  the first bucket at most `first_bucket_mb`, when given, so that communication starts early).
  With `reorder_buckets`, the first synchronising backward records the order in which gradients
  were actually produced; group rank 0's order is broadcast (one int64 per parameter, once) and
  every rank packs its buckets anew in that order, so the collectives still match.
  Each `param.grad` is a view into its bucket, so autograd accumulates straight into it. A
  complete bucket is all-reduced asynchronously while backward goes on, strictly in bucket order,
  so every rank issues the same collectives in the same order; at the end of backward the buckets
  still waiting are launched, all are waited for and divided by N.
- Inside `no_sync()` nothing is communicated: gradients accumulate locally in the buckets and the
  next synchronising backward reduces the sum.
- Unused parameters are looked for on the first synchronising backward (an error unless
  `allow_unused`). With `allow_unused` their slices count as zero, every bucket is still reduced,
  and one flag per parameter is all-reduced (max) so that a parameter no rank used keeps
  `.grad = None`, as in the single-process model.
- `on_bucket_reduced(k)` (flat_adamw.py's overlapped optimizer) is called as soon as bucket k is
  averaged; `after_reorder` callbacks run once the buckets were packed anew.

Cost per synchronising step, with G the gradient bytes on the wire (Σ numel · itemsize of the
trainable parameters in the comm dtype) and the ring algorithm: each rank sends 2(N−1)/N · G bytes
in about G / bucket_mb calls (+ P bytes, P parameters, with `allow_unused`). Memory: the
gradients live in the buckets, no extra copy; a comm dtype other than the parameters' (bf16)
adds one buffer per bucket, G bytes in total. The fp32 comm dtype reduces float64 parameters'
gradients in float64 (`reduction_dtype`), so a float64 model is never narrowed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ndtrain.config import ParallelConfig
from ndtrain.dist.comm import Pending
from ndtrain.errors import UserError
from ndtrain.dist.mesh import ParallelContext
from ndtrain.dist.memory import optimizer_state_bytes, tensor_bytes
from ndtrain.parallel.data.buckets import MB, AllReduceBucket, BucketKind, GradientBuckets, broadcast_state
from ndtrain.parallel.data.flat_adamw import FlatAdamW
from ndtrain.parallel.data.held_slices import WholeParameters
from ndtrain.parallel.data.host_buckets import host_all_reduce_bucket
from ndtrain.parallel.grad_norm import GradPiece, optimizer_param_grads, whole_pieces
from ndtrain.parallel.pipeline.hooks import StageHooks
from ndtrain.parallel.precision import DTYPES


class DistributedDataParallel(nn.Module):
    """Wrap `module` so that `loss.backward()` leaves the gradient averaged over `ctx.group("dp_cp")`.

    The hooks hold the wrapper weakly; once it is dropped they are removed (the module's `.grad`s
    stay views of the old buckets until replaced).
    """

    def __init__(
        self, module: nn.Module, ctx: ParallelContext, *, bucket_mb: float = 25.0,
        comm_dtype: torch.dtype = torch.float32, allow_unused: bool = False,
        first_bucket_mb: float | None = None, reorder_buckets: bool = False, bucket_kind: BucketKind | None = None,
        host_slots: bool = False,
    ) -> None:
        """`first_bucket_mb`: cap of the first bucket (None, or more than `bucket_mb`: `bucket_mb`);
        `reorder_buckets`: pack the buckets in the order the first synchronising backward produced
        gradients; `bucket_kind`: what each bucket's collective is (ZeRO-1's wrapper reduce-scatters,
        zero1_gradients.py; the no-communication benchmark limit passes its own); default: all-reduce,
        through shared-memory slots where the group's ranks share a host and `host_slots` is set
        (host_buckets.py), else through the backend."""
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
        first_cap = None if first_bucket_mb is None else min(cap, max(1, int(first_bucket_mb * MB)))
        self._grads = GradientBuckets(
            [p for _, p in named], ctx.comm, self.group,
            bucket_kind or (host_all_reduce_bucket if host_slots else AllReduceBucket), cap_bytes=cap,
            comm_dtype=comm_dtype, end_of_backward=self._finish_sync, first_cap_bytes=first_cap,
        )
        self._buckets: list[AllReduceBucket] = self._grads.buckets  # type: ignore[assignment]
        self._checked_unused = allow_unused
        self._reorder_pending = reorder_buckets
        self.after_reorder: list[Callable[[], None]] = []

    # ----------------------------------------------------------------------------- public surface
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def buckets(self) -> tuple[AllReduceBucket, ...]:
        """The gradient buckets in launch order (their `params`, `flat` storage and per-parameter `views`)."""
        return tuple(self._buckets)

    gradients_sharded = False  # every rank holds the whole averaged gradient (zero1_optimizer.GradientSource)

    def gradient_slice(self, bucket: int, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of gradient bucket `bucket` (a view)."""
        return self._buckets[bucket].gradient_slice(start, end)

    @property
    def on_bucket_reduced(self) -> Callable[[int], None] | None:
        """Called with k as soon as bucket k is averaged (during backward, in bucket order); None: nobody."""
        return self._grads.on_complete

    @on_bucket_reduced.setter
    def on_bucket_reduced(self, listener: Callable[[int], None] | None) -> None:
        self._grads.on_complete = listener

    def bucket_names(self) -> list[list[str]]:
        """The parameter names of every bucket, in launch order."""
        names = {id(p): name for name, p in zip(self._names, self._grads.params)}
        return [[names[id(p)] for p in b.params] for b in self._buckets]

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

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside accumulate gradients locally; the next one outside reduces the sum."""
        return self._grads.sync.off()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the buckets in place, keeping every `.grad` a bucket view (`set_to_none` drops them)."""
        if set_to_none:
            super().zero_grad(set_to_none=True)  # also parameters outside the buckets
            self._grads.release()
            return
        self._grads.zero_grad()

    # ----------------------------------------------------------------------------- backward
    def _finish_sync(self) -> None:
        """End of a synchronising backward: reduce whatever is left, wait, average."""
        error = self._first_unused_check()
        self._grads.launch_all()
        usage = self._launch_usage() if self.allow_unused else None
        self._grads.complete_all()
        if usage is not None:
            used_anywhere, pending = usage
            pending.wait()
            for param, used in zip(self._grads.params, used_anywhere.tolist()):
                if not used:  # no rank produced a gradient: keep .grad None, as without DDP
                    param.grad = None
        if error is not None:
            raise error
        if self._reorder_pending:
            self._reorder_pending = False
            self._reorder()

    def _reorder(self) -> None:
        """Pack the buckets in the order gradients arrived on group rank 0 (broadcast, so all ranks agree);
        parameters that got none follow in registration-reversed order. Gradients held are carried over."""
        count = len(self._grads.params)
        arrived = list(dict.fromkeys(self._grads.arrival))
        seen = set(arrived)
        order = torch.tensor(arrived + [i for i in range(count) if i not in seen], dtype=torch.int64,
                             device=self._grads.params[0].device)
        self.ctx.comm.broadcast(order, self.group, src=0)
        none = [p for p in self._grads.params if p.grad is None]
        self._grads.reorder(order.tolist())
        self._buckets = self._grads.buckets  # type: ignore[assignment]
        for param in none:
            param.grad = None
        for callback in self.after_reorder:
            callback()

    def _launch_usage(self) -> tuple[torch.Tensor, Pending]:
        """One flag per parameter, max-reduced: was it used on any rank since the last sync?"""
        flags = torch.tensor(self._grads.used, dtype=torch.uint8, device=self._grads.params[0].device)
        pending = self.ctx.comm.all_reduce(flags, self.group, op=dist.ReduceOp.MAX, async_op=True)
        assert pending is not None
        return flags, pending

    def _first_unused_check(self) -> UserError | None:
        """On the first synchronising backward (without allow_unused): the error naming unused parameters."""
        if self._checked_unused:
            return None
        self._checked_unused = True
        unused = [name for name, used in zip(self._names, self._grads.used) if not used]
        if not unused:
            return None
        return UserError(
            f"parameters received no gradient: {', '.join(reversed(unused))}; "
            "set parallel.allow_unused_params=true if that is intended"
        )


# ----------------------------------------------------------------------------- data-parallel strategy (ZeRO-0)
def ddp_chunks(
    model: nn.Module, ctx: ParallelContext, cfg: ParallelConfig, *, levers: bool = False,
    wrapper: Callable[..., DistributedDataParallel] = DistributedDataParallel,
) -> list[DistributedDataParallel]:
    """`model` wrapped in DDP as configured (`cfg`): one wrapper, or one per chunk of an
    interleaved pipeline (a ModuleList of stage chunks, each with its own buckets). `levers`: also
    `first_bucket_mb` and `reorder_buckets` (for zero 0 in fp32 only: ZeRO-1 and the masters of
    mixed precision lay their buffers out over the buckets as built). `wrapper`: the DDP class
    (ZeRO-1 passes its reduce-scattering `Zero1DataParallel`)."""
    comm_dtype = DTYPES[cfg.comm_dtype]
    options: dict[str, Any] = {"first_bucket_mb": cfg.first_bucket_mb, "reorder_buckets": cfg.reorder_buckets} if levers else {}
    options["host_slots"] = cfg.host_shared_memory
    if isinstance(model, nn.ModuleList):
        return [wrapper(chunk, ctx, bucket_mb=cfg.bucket_mb, comm_dtype=comm_dtype, **options) for chunk in model]
    return [wrapper(model, ctx, bucket_mb=cfg.bucket_mb, comm_dtype=comm_dtype, allow_unused=cfg.allow_unused_params,
                    **options)]


def build_ddp(module: nn.Module, ctx: ParallelContext, cfg: ParallelConfig,
              make_optimizer: Callable[[], torch.optim.Optimizer]) -> DDPStrategy:
    """ZeRO-0 in fp32 with `cfg`'s DDP levers: a small first bucket, buckets in the recorded order, the
    caller's AdamW replaced by `FlatAdamW` (`flat_adamw`; one wrapper, no unused parameters: else the
    caller's optimizer as it is) and its update overlapped with the bucket all-reduces
    (`overlap_optimizer`, without a pipeline, when the engine allows it: `step_during_backward`)."""
    chunks = ddp_chunks(module, ctx, cfg, levers=True)
    optimizer = make_optimizer()
    flat = None
    if cfg.flat_adamw and len(chunks) == 1 and not cfg.allow_unused_params:
        flat = FlatAdamW.replacing(chunks[0], optimizer)
    return DDPStrategy(chunks, flat or optimizer, ctx, overlap=flat if cfg.overlap_optimizer and cfg.pp == 1 else None)


@contextlib.contextmanager
def all_no_sync(chunks: Sequence[DistributedDataParallel]) -> Iterator[None]:
    """Every chunk's `no_sync` at once (an interleaved pipeline's chunks each have their own buckets)."""
    with contextlib.ExitStack() as stack:
        for chunk in chunks:
            stack.enter_context(chunk.no_sync())
        yield


def held_gradient_bytes(chunks: Sequence[DistributedDataParallel]) -> int:
    """Bytes of gradient the wrappers hold now: their buckets, plus the comm-dtype copies (ZeRO-1 on one
    host: the shards and the parameters' own `.grad`s, which exist from backward to `zero_grad`)."""
    return sum(b.held_bytes() for chunk in chunks for b in chunk.buckets)


class DDPStrategy(WholeParameters):
    """ZeRO-0 in fp32 (a `DataParallelStrategy`, strategy.py): DDP wrappers (one, or one per interleaved
    pipeline chunk) and the caller's optimizer over the whole model. Gradients are replicated, so the
    norm's pieces are whole `.grad`s, summed over mp only; a checkpoint reads every parameter whole
    and its optimizer state (identical on every replica); the pipeline runner is handed each chunk's
    `no_sync` (the chunk all-reduces in its last backward of the step)."""

    grads_sharded = False
    sharded_model = None
    forward_communicates = False

    def __init__(self, chunks: list[DistributedDataParallel], optimizer: torch.optim.Optimizer, ctx: ParallelContext,
                 *, overlap: FlatAdamW | None = None) -> None:
        """`overlap`: the flat optimizer that may update buckets during backward, when the engine allows it."""
        self.chunks: list[nn.Module] = list(chunks)
        self.module: nn.Module = chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)
        self.optimizer = optimizer
        self.stage_hooks = [StageHooks(no_sync=lambda c=chunk: c.no_sync()) for chunk in chunks]
        self._tp = ctx.group("tp").size
        self._overlap = overlap

    def step_during_backward(self, allowed: bool) -> None:
        if self._overlap is not None:
            self._overlap.set_overlap(allowed)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return all_no_sync(self.chunks)

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
