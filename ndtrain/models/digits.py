"""A small CNN for 8×8 digit images that learns an embedding for retrieval.

conv 3×3 (1→32) → ReLU → conv 3×3 (32→64) → ReLU → max-pool 2 (4×4) → conv 3×3 (64→64) → ReLU →
max-pool 2 (2×2) → flatten 256 → linear 256→128 → ReLU → linear 128→D (the embedding, D =
`model.dim`, 64 by default) → linear D→10 (class logits). Training loss: mean cross-entropy of the
logits. Retrieval uses the L2-normalised embedding. No batch norm or dropout: no buffers, so every
data-parallel mode (including single-process replicas) computes exactly what one process would.

`forward(images, labels)` returns the loss (what the engine trains and evaluates);
`forward(images)` returns the normalised embeddings [B, D].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CLASSES = 10


class DigitsNet(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.project = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, dim))
        self.classifier = nn.Linear(dim, CLASSES)

    def embedding(self, images: torch.Tensor) -> torch.Tensor:
        """Unnormalised embeddings [B, D] of images [B, 1, 8, 8] (cast to the weights' dtype)."""
        return self.project(self.features(images.to(self.classifier.weight.dtype)))

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        z = self.embedding(images)
        if labels is None:
            return F.normalize(z, dim=1)
        return F.cross_entropy(self.classifier(z), labels)


def build_digits_model(dim: int, seed: int) -> DigitsNet:
    """The model initialised from `seed`: identical in every process; the caller's RNG is untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DigitsNet(dim)
