"""scikit-learn's bundled handwritten digits (1,797 8×8 images, 10 classes; shipped inside the
package, nothing is downloaded) as a training set, a validation set and a held-out test set.

Split (fixed, independent of the run's seed, so figures of different runs compare), each step
stratified by class with `sklearn.model_selection.train_test_split(random_state=0)`:
- 30 % of the images are the test set (540), used only for the run's final score;
- 20 % of the rest are the validation set (252), used at every evaluation (loss, retrieval);
- the remaining 1,005 images are the training set.
The validation and test sets are each split again, stratified, into a query third (84; 180) and a
gallery (168; 360). Pixels (0–16) are scaled to [0, 1]; an item is (image [1, 8, 8] float32, label
int64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ndtrain.errors import UserError
from ndtrain.eval.retrieval import LabeledSet

SPLIT_SEED = 0
TEST_FRACTION = 0.3
VALIDATION_FRACTION = 0.2  # of what the test set leaves
QUERY_SHARE = 3  # a third of a retrieval set queries the other two thirds


class ImageSet:
    """Images [n, 1, 8, 8] and labels [n], indexed like the trainer's token windows: item i is (x, y)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, name: str) -> None:
        self.images, self.labels, self.name = images, labels, name

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]

    def labeled(self) -> LabeledSet:
        return LabeledSet(self.images, self.labels)


@dataclass(frozen=True)
class RetrievalSplit:
    """A held-out set as retrieval sees it: `query` searches `gallery`; `joined` (query followed by
    gallery) is the set whose loss is measured."""

    joined: ImageSet
    query: ImageSet
    gallery: ImageSet


@dataclass(frozen=True)
class DigitsSplit:
    train: ImageSet
    val: RetrievalSplit   # every evaluation
    test: RetrievalSplit  # the final score only


def _sklearn() -> tuple[Callable[..., Any], Callable[..., Any]]:
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise UserError("--model digits needs scikit-learn: pip install 'ndtrain[vision]'") from None
    return load_digits, train_test_split


def load_digits_split() -> DigitsSplit:
    load_digits, train_test_split = _sklearn()
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    part = lambda rows, name: ImageSet(images[rows], labels[rows], name)
    split = lambda rows, size: train_test_split(rows, test_size=size, stratify=digits.target[rows],
                                                random_state=SPLIT_SEED)

    def retrieval(rows: list[int], name: str) -> RetrievalSplit:
        query, gallery = train_test_split(rows, train_size=len(rows) // QUERY_SHARE, stratify=digits.target[rows],
                                          random_state=SPLIT_SEED)
        return RetrievalSplit(part(query + gallery, name), part(query, f"{name} query"), part(gallery, f"{name} gallery"))

    rest, test = split(list(range(len(labels))), TEST_FRACTION)
    train, val = split(rest, VALIDATION_FRACTION)
    return DigitsSplit(part(train, "train"), retrieval(val, "validation"), retrieval(test, "test"))
