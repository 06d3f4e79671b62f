"""Parameter counting for any model: what the engines report as a run's size (Ψ).

Neutral ground below the engines and every model: it knows `nn.Module`, nothing of ndtrain."""

from __future__ import annotations

from torch import nn


def count_parameters(model: nn.Module, trainable: bool = False) -> int:
    """Number of parameter elements, a tied (shared) tensor counted once (`trainable`: those requiring grad only)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)
