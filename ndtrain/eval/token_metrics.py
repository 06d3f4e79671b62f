"""Next-token metrics of an evaluation: perplexity and accuracy over the target tokens, under every layout.

`Evaluation` is what `Engine.evaluate` and `PSEngine.evaluate` return: the mean loss per target
token, the target count, and the next-token accuracy (the argmax of the logits equals the target,
over the targets other than `IGNORE_INDEX`); `perplexity` is exp of the mean loss.

How the accuracy is measured without changing the model contract (`model(tokens, targets)` → the
loss): `scoring(model)` swaps, for one evaluation, every `loss_fn` seam of the model's modules (the
built-in Llama and its pipeline stages, the `CausalLM` adapter and its stages) for one that also
counts the correct predictions in the logits it is handed into a `Tally`, and restores them after.
A seam offering `correct(logits, targets)` counts by it (tensor parallel's vocab-parallel loss: an
argmax combined over the logit shards, parallel/model/vocab.py); any other by `correct_predictions`.
A model without such a seam (a task's classifier) or evaluated through a caller's `loss_fn` has no
accuracy (None): what its output means is the caller's.

Layouts: each rank's tally counts what its own seam sees: its batches (dp), its sequence shard (cp),
the same count on every tp rank (the argmax is already combined over tp), nothing but on the last
pipeline stage. The engine sums it with the loss over dp×cp (and over pp), so every target is
counted once. Cost: one argmax over each forward's logits, a 16-byte tally added to the engine's one
all-reduce (plus one over pp under pipeline parallelism); no host synchronisation per batch.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from ndtrain.parallel.target_mean import IGNORE_INDEX

LOSS_SEAM = "loss_fn"

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Evaluation:
    loss: float                 # mean loss per target token (nan without targets)
    tokens: int                 # targets evaluated, over every rank, each once
    accuracy: float | None      # next-token accuracy over the targets ≠ IGNORE_INDEX; None: not measured

    @property
    def perplexity(self) -> float:
        """exp(mean loss per target token); inf past float range."""
        try:
            return math.exp(self.loss)
        except OverflowError:
            return math.inf

    def record(self) -> dict[str, float]:
        """The metrics-record fields: val_loss, and with an accuracy val_ppl and val_accuracy."""
        fields = {"val_loss": self.loss}
        if self.accuracy is not None:
            fields.update(val_ppl=self.perplexity, val_accuracy=self.accuracy)
        return fields


def counted_targets(targets: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the targets that count (≠ IGNORE_INDEX)."""
    return targets != IGNORE_INDEX


def correct_predictions(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """How many counted targets [...] equal the argmax of `logits` [..., V] (ties: the lowest index)."""
    return ((logits.argmax(dim=-1) == targets) & counted_targets(targets)).sum()


class Tally:
    """Correct predictions and counted targets, accumulated on the device (float64 [2])."""

    def __init__(self) -> None:
        self.totals: torch.Tensor | None = None

    def add(self, correct: torch.Tensor, targets: torch.Tensor) -> None:
        counts = torch.stack([correct.double(), counted_targets(targets).sum().double()])
        self.totals = counts if self.totals is None else self.totals + counts.to(self.totals.device)

    def take(self, device: torch.device) -> torch.Tensor:
        """The totals since the last take (zeros if none), on `device`; resets them."""
        totals, self.totals = self.totals, None
        return torch.zeros(2, dtype=torch.float64, device=device) if totals is None else totals.to(device)


class _Scored:
    """A loss seam that also adds its logits' correct predictions to a tally."""

    def __init__(self, loss_fn: LossFn, tally: Tally) -> None:
        self.loss_fn, self.tally = loss_fn, tally
        self.count: LossFn = getattr(loss_fn, "correct", correct_predictions)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(logits, targets)
        self.tally.add(self.count(logits.detach(), targets), targets)
        return loss


@contextlib.contextmanager
def scoring(model: nn.Module) -> Iterator[Tally]:
    """Within the block, every `loss_fn` seam among `model`'s modules also counts into the yielded tally."""
    tally = Tally()
    swapped: list[tuple[nn.Module, LossFn | None]] = []  # (module, its own instance attribute or None)
    for module in model.modules():
        seam = getattr(module, LOSS_SEAM, None)
        if callable(seam) and not isinstance(seam, nn.Module):
            swapped.append((module, module.__dict__.get(LOSS_SEAM)))
            setattr(module, LOSS_SEAM, _Scored(seam, tally))
    try:
        yield tally
    finally:
        for module, own in reversed(swapped):
            if own is None:
                delattr(module, LOSS_SEAM)
            else:
                setattr(module, LOSS_SEAM, own)
