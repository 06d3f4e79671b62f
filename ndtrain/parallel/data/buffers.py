"""`parallel.broadcast_buffers`: the module's buffers kept identical over the data-parallel group.

Buffers are module state outside the parameters (BatchNorm's running statistics and batch counter,
counters, caches); a forward may change them in place, each rank from its own shard of the batch,
so the ranks' copies drift apart. Every strategy broadcasts them once, when it wraps the model;
with `parallel.broadcast_buffers = true` the engine calls `BufferBroadcast.sync()` before each
training step (before its first micro-batch: inside a step the buffers evolve on each rank) and
before each evaluation, and every rank continues from group rank 0's buffers, as torch's DDP does
before each forward with its `broadcast_buffers=True`.

Left out: the buffers of `SyncBatchNorm` layers (sync_batchnorm.py), which are identical on every
rank by construction (updated from the group's statistics). Under model parallelism each rank
broadcasts the buffers of its own part over its dp × cp group.

Communication: per call, one broadcast over `dp_cp` per run of same-dtype buffers of at most
`bucket_mb` (buckets.py's `broadcast_state`): B bytes sent by group rank 0 (B the buffers' bytes),
nothing when the model has no buffer or the group one rank. The default is false: ndtrain's own
models hold no buffer that a forward changes besides BatchNorm's, which `parallel.sync_batchnorm`
keeps equal exactly (and a broadcast would only replace the ranks' statistics by rank 0's).
"""

from __future__ import annotations

import torch
from torch import nn

from ndtrain.dist.mesh import ParallelContext
from ndtrain.parallel.data.buckets import MB, broadcast_state
from ndtrain.parallel.data.sync_batchnorm import synchronised_buffers


class BufferBroadcast:
    """`sync()` copies group rank 0's buffers of `module` to every rank of dp × cp (a no-op when not `enabled`)."""

    def __init__(self, module: nn.Module, ctx: ParallelContext, enabled: bool, bucket_mb: float) -> None:
        self.module, self.ctx, self.enabled = module, ctx, enabled
        self.group = ctx.group("dp_cp")
        self.cap = max(1, int(bucket_mb * MB))

    def buffers(self) -> list[torch.Tensor]:
        """The buffers a sync broadcasts, read from the module at each call (casting the module replaces them)."""
        synced = synchronised_buffers(self.module)
        return [b for b in self.module.buffers() if id(b) not in synced]

    def sync(self) -> None:
        if self.enabled and self.group.size > 1:
            broadcast_state(self.ctx, self.group, self.buffers(), self.cap)
