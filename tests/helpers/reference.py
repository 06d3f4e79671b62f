"""The single-process reference trainer that parity tests compare distributed runs against.

One process sees the whole global batch of every step: the loss is the mean of the losses of
`pieces` equal chunks (the mean the distributed runs form from their shards, with the same
rounding), the gradient norm is recorded and clipped to `clip`, then one optimizer (and scheduler)
step. The model is trained in place, so a caller can go on to evaluate it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]
State = dict[str, torch.Tensor]
# (model, index of the chunk, inputs, targets) → that chunk's loss
LossFn = Callable[[nn.Module, int, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Reference:
    """What the reference run ends with: its state dict, its distinct parameters (a tied duplicate
    dropped), and per step the loss and the gradient norm before clipping."""

    state: State
    params: State
    losses: list[float]
    norms: list[float]


def decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Optimizer groups as `no_decay_for_vectors` makes them: matrices decay, vectors (norms, biases) do not."""
    return [{"params": [p for p in model.parameters() if p.ndim >= 2]},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]


def _model_loss(model: nn.Module, piece: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, y)


def train_reference(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Batch],
    *,
    pieces: int = 1,
    clip: float = math.inf,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    loss_fn: LossFn = _model_loss,
) -> Reference:
    """One step per global batch of `batches` (see the module docstring); `clip=inf` does not clip."""
    losses, norms = [], []
    for x, y in batches:
        chunks = zip(x.chunk(pieces), y.chunk(pieces))
        loss = sum(loss_fn(model, i, xs, ys) for i, (xs, ys) in enumerate(chunks)) / pieces
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
    return Reference(
        state={k: v.detach().clone() for k, v in model.state_dict().items()},
        params={k: v.detach().clone() for k, v in model.named_parameters()},
        losses=losses,
        norms=norms,
    )
