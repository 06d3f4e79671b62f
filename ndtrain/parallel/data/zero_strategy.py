"""ZeRO-1 (and ZeRO-0's fp32 masters, ZeRO-2's optimizer) as a data-parallel strategy: a bucketed
gradient wrapper with `ZeroOptimizer`.

What is split and communicated is the parts' own: the gradient side (DDP's `DistributedDataParallel`,
ZeRO-1's reduce-scattering `Zero1DataParallel`, zero1_gradients.py, or ZeRO-2's `Zero2DataParallel`,
zero2_gradients.py) and the optimizer that shards the state over dp×cp and all-gathers the updated
parameters (zero1_optimizer.py). `ZeroStrategy` only drives them: the optimizer reads this rank's
gradient segments, so the norm's pieces are those segments (summed over dp_cp when sharded, one
4-byte all-reduce); a checkpoint reads the segments as parameter pieces and refills the replicated
flat buffers (the compute copies) whole; the pipeline runner is handed each chunk's `no_sync`
(DDP, ZeRO-1: local accumulation) or `weight_pass` (ZeRO-2: sharded every micro-batch).

Builders: `build_zero1` here (ZeRO-1), `build_replicated` (replicated.py: ZeRO-0, whose bf16/fp16
masters are an unsharded `ZeroOptimizer`), `build_zero2` (zero2_gradients.py). In bf16/fp16
`cast_to_compute` casts the model and keeps its fp32 initial weights for the masters (+4Ψ/N bytes).
"""

from __future__ import annotations

import functools
from collections.abc import MutableMapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Callable

import torch
from torch import nn

from ndtrain.config import ParallelConfig
from ndtrain.dist.memory import optimizer_state_bytes, tensor_bytes
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.data.chunks import DataParallelChunks
from ndtrain.parallel.data.ddp import DistributedDataParallel, all_no_sync, ddp_chunks, held_gradient_bytes
from ndtrain.parallel.data.held_slices import HeldSlice, whole
from ndtrain.parallel.data.param_groups import GroupFn, OptimizerFn
from ndtrain.parallel.data.zero1_gradients import Zero1DataParallel
from ndtrain.parallel.data.zero1_optimizer import GradientSource, ZeroOptimizer
from ndtrain.parallel.grad_norm import GradPiece
from ndtrain.parallel.pipeline.hooks import StageHooks
from ndtrain.parallel.precision import DTYPES


def cast_to_compute(model: nn.Module, dtype: torch.dtype) -> dict[int, torch.Tensor] | None:
    """Cast `model` to the compute `dtype` (bf16/fp16) and return its fp32 initial weights by
    `id(param)`, for `ZeroOptimizer(masters=...)`; None (nothing cast) in fp32."""
    if dtype == torch.float32:
        return None
    masters = {id(p): p.detach().clone() for p in model.parameters()}
    model.to(dtype)
    return masters


class ZeroStrategy:
    """`DataParallelStrategy` (strategy.py) of a bucketed gradient wrapper with `ZeroOptimizer`; see
    the module docstring."""

    sharded_model = None
    forward_communicates = False

    def __init__(
        self, gradients: GradientSource, optimizer: ZeroOptimizer, *,
        no_sync: Callable[[], AbstractContextManager[None]], gradient_bytes: Callable[[], int],
        stage_hooks: list[StageHooks], release: bool = False, chunks: Sequence[nn.Module] | None = None,
    ) -> None:
        """`no_sync()`: the context of a micro-batch whose gradient need not be synchronised yet;
        `gradient_bytes()`: bytes of gradient `gradients` holds; `stage_hooks`: the pipeline runner's,
        one per chunk; `release`: `zero_grad` drops the parameters' `.grad`s (ZeRO-1 on one host, whose
        gradients are autograd's own until reduced); `chunks`: the modules to run (an interleaved
        pipeline's wrapped chunks; default `gradients` itself)."""
        self.module: nn.Module = gradients  # type: ignore[assignment]
        self.chunks: list[nn.Module] = list(chunks) if chunks is not None else [self.module]
        self.optimizer = optimizer
        self.no_sync = no_sync
        self.stage_hooks = stage_hooks
        self._gradient_bytes = gradient_bytes
        self._release = release
        self._norm_spans = optimizer.norm_spans(optimizer.ctx.group("tp").size)
        self._bucketed = {id(p) for b in gradients.buckets for p in b.params}

    @property
    def grads_sharded(self) -> bool:
        return self.optimizer.sharded

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=self._release)

    def step_during_backward(self, allowed: bool) -> None:
        """Never: the step updates shards and all-gathers them after the norm."""

    def optimizer_grads(self) -> list[torch.Tensor]:
        return self.optimizer.prepare_grads()

    def grad_pieces(self) -> list[GradPiece]:
        return self.optimizer.norm_pieces(self.optimizer.prepare_grads(), self._norm_spans)

    def state_bytes(self) -> dict[str, int]:
        """Parameters: the bucketed ones' (`ZeroOptimizer`) plus those left out of the buckets (frozen), whole."""
        unbucketed = sum(tensor_bytes(p) for p in self.module.parameters() if id(p) not in self._bucketed)
        return {"parameters": self.optimizer.parameter_bytes() + unbucketed, "gradients": self._gradient_bytes(),
                "optimizer": optimizer_state_bytes(self.optimizer) + self.optimizer.master_bytes}

    def held_slices(self) -> list[HeldSlice]:
        """This rank's segments of every bucket, then the parameters left out of the buckets (frozen) whole."""
        return self.optimizer.held_slices() + whole(p for p in self.module.parameters() if id(p) not in self._bucketed)

    def compute_copies(self) -> list[nn.Parameter]:
        """The bucketed parameters: views of the replicated flat buffers (compute dtype), refilled whole on load."""
        return [p for p in self.module.parameters() if id(p) in self._bucketed]

    def optimizer_state(self) -> MutableMapping[torch.Tensor, dict[str, Any]]:
        return self.optimizer.state


def zero_over_ddp(chunks: list[DistributedDataParallel], ctx: ParallelContext, optimizer_fn: OptimizerFn,
                  group_fn: GroupFn, *, masters: dict[int, torch.Tensor] | None, sharded: bool) -> ZeroStrategy:
    """`ZeroOptimizer` over DDP wrappers: `chunks` is one wrapper, or an interleaved pipeline's chunks
    (one bucket sequence over all of them); `sharded=False` keeps the whole state on every rank."""
    source = chunks[0] if len(chunks) == 1 else DataParallelChunks(chunks)
    optimizer = ZeroOptimizer(source, ctx, optimizer_fn, group_fn=group_fn, masters=masters, sharded=sharded)
    return ZeroStrategy(source, optimizer, no_sync=functools.partial(all_no_sync, chunks),
                        gradient_bytes=lambda: held_gradient_bytes(chunks), chunks=chunks,
                        stage_hooks=[StageHooks(no_sync=lambda c=chunk: c.no_sync()) for chunk in chunks],
                        release=any(b.transient for b in source.buckets))


def build_zero1(model: nn.Module, ctx: ParallelContext, cfg: ParallelConfig, optimizer_fn: OptimizerFn, group_fn: GroupFn, *,
                wrap: Callable[[nn.Module], nn.Module] = lambda module: module) -> ZeroStrategy:
    """ZeRO-1: `Zero1DataParallel` (over `wrap(model)`: DDP that reduce-scatters each bucket into
    this rank's range) with the optimizer state sharded over dp_cp."""
    masters = cast_to_compute(model, DTYPES[cfg.precision])
    return zero_over_ddp(ddp_chunks(wrap(model), ctx, cfg, wrapper=Zero1DataParallel), ctx, optimizer_fn, group_fn,
                         masters=masters, sharded=True)
