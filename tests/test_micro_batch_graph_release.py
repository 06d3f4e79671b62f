"""A step's micro-batches do not overlap in memory: micro-batch i's autograd graph is released before
micro-batch i + 1's forward (engine.py, `_forward_backward`).

Held until the next forward returned, the graph's nodes (small C-heap blocks that outlive its saved
tensors) sat between micro-batch i's freed activations on glibc's heap, so micro-batch i + 1's
activations came from fresh pages instead: with two micro-batches per rank (tp2 of docs/planner.md's
measured memory check) the peak resident set was ~60 MiB higher. The probe keeps a weak reference to
an object each forward's graph holds (on a custom autograd node's ctx) and reads it during the next
forward.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ndtrain.config import ParallelConfig
from ndtrain.dist.mesh import init
from ndtrain.engine import Engine


class _Marker:
    """An object a graph keeps alive exactly as long as the graph itself."""


class _Tagged(torch.autograd.Function):
    """Identity; its node (ctx) holds a `_Marker`, so the marker dies with the graph."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, marker: _Marker) -> torch.Tensor:
        ctx.marker = marker
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(8, 8)
        self.previous: weakref.ref[_Marker] | None = None
        self.graphs_alive_at_forward: list[bool] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # is the previous micro-batch's graph still reachable while this one's forward runs?
        self.graphs_alive_at_forward.append(self.previous is not None and self.previous() is not None)
        marker = _Marker()
        self.previous = weakref.ref(marker)
        out = _Tagged.apply(self.linear(x), marker)
        return nn.functional.mse_loss(out, y)


def test_each_micro_batch_graph_is_released_before_the_next_forward() -> None:
    engine = Engine(_Probe, lambda groups: torch.optim.AdamW(groups, lr=1e-2), init(ParallelConfig()), ParallelConfig())
    generator = torch.Generator().manual_seed(0)
    micro_batches = [(torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)) for _ in range(3)]
    for _ in range(2):
        engine.train_step(micro_batches)
    probe = engine.model
    assert isinstance(probe, _Probe)
    assert probe.graphs_alive_at_forward == [False] * 6
    assert probe.previous is not None and probe.previous() is None  # nor does the step keep the last one
