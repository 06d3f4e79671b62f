"""An interleaved pipeline's stage chunks, each in its own data-parallel wrapper, seen as one model.

With `--vpp` v > 1 a rank holds v stage chunks, and each is wrapped on its own over dp×cp, so that
each chunk's gradients are reduced in that chunk's own backwards (pipeline/runner.py, through each
chunk's `StageHooks`):

- `DataParallelChunks`: v bucketed gradient wrappers, DDP's `DistributedDataParallel` (ZeRO-0/1,
  and the fp32 masters of bf16/fp16) or ZeRO-2's `Zero2DataParallel`, as the one `GradientSource`
  that `ZeroOptimizer` (zero1_optimizer.py) reads: the chunks' buckets in chunk order as one
  sequence, so the optimizer shards, updates and all-gathers every chunk's buckets as it would one
  model's. DDP chunks all-reduce in their last backward of the step (the others run under
  `no_sync`); ZeRO-2 chunks reduce-scatter every backward into their gradient shards.
- `FullyShardedChunks`: v ZeRO-3 `FullyShardedDataParallel` wrappers (each its own units over the
  chunk's blocks and root) as one sharded model: all their units, one optimizer's parameter groups
  over all their shards, and the rank's whole state dict (zero3_strategy.py).

Nothing more is communicated than for one model of the chunks' combined size split into the same
buckets or units; each chunk's collectives are issued in its own backwards (every rank of the
dp×cp group runs the same action list, so they match).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ndtrain.parallel.data.param_groups import GroupFn


class DataParallelChunks(nn.ModuleList):
    """v bucketed gradient wrappers (index = chunk) with one bucket sequence over all of them."""

    def __init__(self, chunks: list[nn.Module]) -> None:
        super().__init__(chunks)
        kinds = {bool(chunk.gradients_sharded) for chunk in chunks}
        assert len(kinds) == 1, "the chunks of one rank are wrapped alike"
        self.gradients_sharded: bool = kinds.pop()  # DDP: all-reduced, replicated; ZeRO-2: sharded
        self._owner = [(c, k) for c, chunk in enumerate(chunks) for k in range(len(chunk.buckets))]

    @property
    def module(self) -> nn.ModuleList:
        """The unwrapped chunks, named like the engine's chunk list ("0.layers.1...", "1.layers.3...")."""
        return nn.ModuleList(chunk.module for chunk in self)

    @property
    def buckets(self) -> tuple[Any, ...]:
        return tuple(bucket for chunk in self for bucket in chunk.buckets)

    def gradient_slice(self, bucket: int, start: int, end: int) -> torch.Tensor:
        chunk, local = self._owner[bucket]
        return self[chunk].gradient_slice(local, start, end)

    def zero_grad(self, set_to_none: bool = False) -> None:
        for chunk in self:
            chunk.zero_grad(set_to_none=set_to_none)


class FullyShardedChunks(nn.ModuleList):
    """v `FullyShardedDataParallel` stage chunks (index = chunk) seen as one sharded model."""

    @property
    def units(self) -> list[Any]:
        """Every chunk's `FlatUnit`s, chunk by chunk."""
        return [unit for chunk in self for unit in chunk.units]

    @property
    def ctx(self) -> Any:
        return self[0].ctx

    def parameter_groups(self, group_fn: GroupFn) -> list[dict[str, Any]]:
        """Each chunk's `parameter_groups(group_fn)` merged by their options, in order of first appearance
        over the chunks: one list of groups over all the chunks' shards (call once)."""
        merged: dict[tuple, dict[str, Any]] = {}
        for chunk in self:
            for group in chunk.parameter_groups(group_fn):
                options = {k: v for k, v in group.items() if k != "params"}
                merged.setdefault(tuple(sorted(options.items())), {"params": [], **options})["params"] += group["params"]
        return list(merged.values())

    def zero_grad(self, set_to_none: bool = False) -> None:
        for chunk in self:
            chunk.zero_grad(set_to_none=set_to_none)

    def state_bytes(self) -> dict[str, int]:
        """"parameters" and "gradients" this rank holds now, summed over the chunks."""
        held = [chunk.state_bytes() for chunk in self]
        return {key: sum(h[key] for h in held) for key in held[0]}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The rank's stages' weights under the unsharded names (collective over dp×cp, chunk by chunk)."""
        out: dict[str, torch.Tensor] = {}
        for chunk in self:
            out.update(chunk.full_state_dict())
        return out
