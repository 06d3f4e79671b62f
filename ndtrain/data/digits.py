"""scikit-learn's bundled handwritten digits (1,797 8×8 images, 10 classes; shipped inside the
package, nothing is downloaded) as a training set and a retrieval test set.

Split (fixed, independent of the run's seed, so figures of different runs compare): stratified by
class with `sklearn.model_selection.train_test_split(random_state=0)`: 70 % train (1,257 images),
30 % test (540); the test set is split again, stratified, into a query third (180) and a gallery
(360). Pixels (0–16) are scaled to [0, 1]; an item is (image [1, 8, 8] float32, label int64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ndtrain.errors import UserError
from ndtrain.eval.retrieval import LabeledSet

SPLIT_SEED = 0
TEST_FRACTION = 0.3
QUERY_SHARE = 3  # a third of the test set queries the other two thirds


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
class DigitsSplit:
    train: ImageSet
    test: ImageSet      # query followed by gallery: the validation-loss set
    query: ImageSet
    gallery: ImageSet


def _sklearn():  # type: ignore[no-untyped-def]
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
    index = list(range(len(labels)))
    train, test = train_test_split(index, test_size=TEST_FRACTION, stratify=digits.target, random_state=SPLIT_SEED)
    query, gallery = train_test_split(
        test, train_size=len(test) // QUERY_SHARE, stratify=digits.target[test], random_state=SPLIT_SEED
    )
    part = lambda rows, name: ImageSet(images[rows], labels[rows], name)
    return DigitsSplit(part(train, "train"), part(query + gallery, "test"), part(query, "query"), part(gallery, "gallery"))
