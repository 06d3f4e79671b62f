"""ZeRO-3 as a data-parallel strategy: `FullyShardedDataParallel` and the caller's optimizer over its shards.

What is split and communicated is the wrapper's (zero3_parameters.py): parameters, gradients and
optimizer state over dp×cp; forwards all-gather each unit, every micro-batch's backward
reduce-scatters it (there is no `no_sync`: the gradient memory stays sharded), so evaluation pads
ranks with fewer batches (`forward_communicates`). The optimizer is the caller's, built over the
units' fp32 shard segments; the gradient norm sums this rank's shard gradients over dp_cp (one
4-byte all-reduce). An interleaved pipeline's chunks are each a wrapper of their own
(`FullyShardedChunks`, chunks.py) with one optimizer over all their shards. A checkpoint reads each
unit's segments (`FlatUnit.held_slices`); the pipeline runner is handed each chunk's `input_pass`
and `weight_pass` (zb's split backward, zero3_split_passes.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import MutableMapping
from typing import Any

import torch
from torch import nn

from ndtrain.config import ParallelConfig
from ndtrain.dist.memory import optimizer_state_bytes
from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.data.chunks import FullyShardedChunks
from ndtrain.parallel.data.held_slices import HeldSlice, whole
from ndtrain.parallel.data.param_groups import GroupFn, OptimizerFn
from ndtrain.parallel.data.zero3_parameters import FullyShardedDataParallel, unit_norm_spans
from ndtrain.parallel.grad_norm import GradPiece, flat_pieces, optimizer_param_grads
from ndtrain.parallel.pipeline.hooks import StageHooks
from ndtrain.parallel.precision import DTYPES


class FSDPStrategy:
    """ZeRO-3 as a `DataParallelStrategy` (strategy.py); see the module docstring."""

    grads_sharded = True
    forward_communicates = True

    def __init__(self, fsdp: FullyShardedDataParallel | FullyShardedChunks, chunks: list[FullyShardedDataParallel],
                 optimizer: torch.optim.Optimizer) -> None:
        """`fsdp`: the wrapper, or an interleaved pipeline's chunks each in its own (`chunks`: the wrappers)."""
        self.module: nn.Module = fsdp
        self.chunks: list[nn.Module] = list(chunks)
        self.sharded_model = fsdp
        self.optimizer = optimizer
        self.stage_hooks = [StageHooks(gradients_sharded=True, input_pass=lambda c=c: c.input_pass(),
                                       weight_pass=lambda c=c: c.weight_pass()) for c in chunks]
        self._norm_spans = unit_norm_spans(fsdp.units, fsdp.ctx.group("tp").size)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        self.sharded_model.zero_grad()

    def step_during_backward(self, allowed: bool) -> None:
        """Never: the optimizer steps the fp32 shards after the norm."""

    def optimizer_grads(self) -> list[torch.Tensor]:
        return optimizer_param_grads(self.optimizer)

    def grad_pieces(self) -> list[GradPiece]:
        return flat_pieces((u.shard_grad for u in self.sharded_model.units), self._norm_spans)

    def state_bytes(self) -> dict[str, int]:
        return {**self.sharded_model.state_bytes(), "optimizer": optimizer_state_bytes(self.optimizer)}

    def held_slices(self) -> list[HeldSlice]:
        """Each unit's segments of this rank's fp32 shard and its frozen shard (every parameter belongs to a unit)."""
        units = self.sharded_model.units
        covered = {id(p) for u in units for p in u.params + u.frozen_params}
        return [h for u in units for h in u.held_slices()] + whole(
            p for p in self.module.parameters() if id(p) not in covered)

    def compute_copies(self) -> list[nn.Parameter]:
        """None: the gathered compute parameters are rebuilt from the shards at every forward."""
        return []

    def optimizer_state(self) -> MutableMapping[torch.Tensor, dict[str, Any]]:
        return self.optimizer.state


def build_zero3(model: nn.Module, ctx: ParallelContext, cfg: ParallelConfig, optimizer_fn: OptimizerFn, group_fn: GroupFn) -> FSDPStrategy:
    """ZeRO-3: the model cut into FSDP units as configured (`fsdp_wrap`, `reshard_after_forward`),
    computing in the configured precision over fp32 shards; an interleaved pipeline's chunks (a
    ModuleList) each in a wrapper of their own, with one optimizer over all their shards."""
    def shard(module: nn.Module) -> FullyShardedDataParallel:
        return FullyShardedDataParallel(
            module, ctx, wrap=cfg.fsdp_wrap, reshard_after_forward=cfg.reshard_after_forward,
            param_dtype=DTYPES[cfg.precision], reduce_dtype=DTYPES[cfg.comm_dtype],
            host_slots=cfg.host_shared_memory,
        )

    chunks = [shard(chunk) for chunk in model] if isinstance(model, nn.ModuleList) else [shard(model)]
    fsdp = FullyShardedChunks(chunks) if isinstance(model, nn.ModuleList) else chunks[0]
    return FSDPStrategy(fsdp, chunks, optimizer_fn(fsdp.parameter_groups(group_fn)))
