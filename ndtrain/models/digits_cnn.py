"""The digits task's BatchNorm CNN (`model.digits_net = "bn_cnn"`), and the choice between the task's models.

Person re-identification's standard models are BatchNorm CNNs; this is one at the digits' scale:
models/digits.py's network with a BatchNorm after every convolution and after the hidden projection
(the layer before each BatchNorm has no bias, which the BatchNorm's β replaces):

conv 3×3 (1→32) → BN → ReLU → conv 3×3 (32→64) → BN → ReLU → max-pool 2 → conv 3×3 (64→64) → BN → ReLU →
max-pool 2 → flatten 256 → linear 256→128 → BN → ReLU → linear 128→D (the embedding) → linear D→10.

Same interface and module names as `DigitsNet` (`features`, `project`, `classifier`: the digits
preset's ZeRO-3 units): `forward(images, labels)` is the mean cross-entropy, `forward(images)` the
L2-normalised embedding. Its buffers (each BatchNorm's running mean and variance and batch counter)
change in every training forward: under data parallelism each rank normalises its own shard and its
statistics drift from the other ranks' unless `parallel.sync_batchnorm` normalises over the global
batch (parallel/data/sync_batchnorm.py). Evaluation and retrieval use the running statistics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ndtrain.models.digits import CLASSES, DigitsNet


class BatchNormDigitsNet(DigitsNet):
    """`DigitsNet`'s embedding and loss over layers of its own (its parent's are never built)."""

    def __init__(self, dim: int = 64) -> None:
        nn.Module.__init__(self)
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.project = nn.Sequential(nn.Linear(256, 128, bias=False), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, dim))
        self.classifier = nn.Linear(dim, CLASSES)


DIGITS_NETS: dict[str, Callable[[int], nn.Module]] = {"cnn": DigitsNet, "bn_cnn": BatchNormDigitsNet}


def build_digits_net(kind: str, dim: int, seed: int) -> nn.Module:
    """The digits model `kind` (`model.digits_net`) initialised from `seed`: identical in every process;
    the caller's RNG is untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DIGITS_NETS[kind](dim)
