"""An interleaved pipeline's stage chunks, each in its own `DistributedDataParallel`, seen as one model.

With `--vpp` v > 1 a rank holds v stage chunks; each is wrapped in DDP over dp×cp and synchronises
in its own last backward (runner.py). `DataParallelChunks` is the list of those v wrappers, and is
also the `GradientSource` that `ZeroOptimizer` reads (ZeRO-1, and the fp32 masters of bf16/fp16):
the chunks' buckets in chunk order as one sequence, so the optimizer shards, updates and
all-gathers every chunk's buckets as it would one model's. Nothing more is communicated than
for one model of the chunks' combined size: ZeRO-1's all-gather of each bucket after the step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ndtrain.parallel.ddp import DistributedDataParallel


class DataParallelChunks(nn.ModuleList):
    """v `DistributedDataParallel` stage chunks (index = chunk) with one bucket sequence over all of them."""

    gradients_sharded = False  # DDP all-reduces: every rank holds the whole averaged gradient

    def __init__(self, chunks: list[DistributedDataParallel]) -> None:
        super().__init__(chunks)
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
